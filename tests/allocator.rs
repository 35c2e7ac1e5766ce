//! The simulated CUDA caching allocator against sequences whose outcome follows
//! from PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp), and the training-loop
//! replay against the schedule's own peak.

use memplan::memory::allocator::{AllocConf, Allocator};

const MIB: u64 = 1 << 20;

fn conf(text: &str) -> AllocConf {
    AllocConf::parse(text).unwrap()
}

/// Allocates each size, returns the blocks.
fn alloc_all(a: &mut Allocator, sizes: &[u64]) -> Vec<usize> {
    sizes.iter().map(|&s| a.malloc(s).unwrap()).collect()
}

#[test]
fn freed_small_segments_do_not_serve_larger_requests() {
    // 16 MiB requests get 16 MiB segments of their own; freed, they cannot merge
    // across segments, so 32 MiB requests need new segments: 8·16 + 4·32 = 256 MiB.
    let mut a = Allocator::new(AllocConf::default(), u64::MAX);
    for b in alloc_all(&mut a, &[16 * MIB; 8]) {
        a.free(b);
    }
    alloc_all(&mut a, &[32 * MIB; 4]);
    let s = a.stats();
    assert_eq!(s.reserved_peak, 256 * MIB);
    assert_eq!(s.segments, 12);
    assert_eq!(s.allocated, 128 * MIB);
}

#[test]
fn freed_large_segments_are_split_for_smaller_requests() {
    // Each freed 32 MiB segment is split in two 16 MiB blocks (the rest, 16 MiB, is
    // more than 1 MiB): 128 MiB in all.
    let mut a = Allocator::new(AllocConf::default(), u64::MAX);
    for b in alloc_all(&mut a, &[32 * MIB; 4]) {
        a.free(b);
    }
    alloc_all(&mut a, &[16 * MIB; 8]);
    assert_eq!(a.stats().reserved_peak, 128 * MIB);
    assert_eq!(a.stats().segments, 4);
}

#[test]
fn expandable_segments_map_20_mib_pages() {
    // 8 · 16 MiB = 128 MiB packed in one segment, mapped in 20 MiB pages: 7 pages.
    let mut a = Allocator::new(conf("expandable_segments:True"), u64::MAX);
    alloc_all(&mut a, &[16 * MIB; 8]);
    assert_eq!(a.stats().reserved_peak, 140 * MIB);
    assert_eq!(a.stats().segments, 1);
    // Without expandable segments: eight 16 MiB segments.
    let mut b = Allocator::new(AllocConf::default(), u64::MAX);
    alloc_all(&mut b, &[16 * MIB; 8]);
    assert_eq!(b.stats().reserved_peak, 128 * MIB);
}

#[test]
fn small_requests_share_2_mib_segments() {
    let mut a = Allocator::new(AllocConf::default(), u64::MAX);
    // 4096 requests of 512 B fill exactly one 2 MiB segment; one more opens another.
    alloc_all(&mut a, &[1; 4096]);
    assert_eq!(a.stats().reserved_peak, 2 * MIB);
    assert_eq!(a.stats().allocated, 2 * MIB);
    a.malloc(1).unwrap();
    assert_eq!(a.stats().reserved_peak, 4 * MIB);
    // A 1 MiB request is small; 1 MiB + 1 B is large and gets a 20 MiB segment.
    let mut b = Allocator::new(AllocConf::default(), u64::MAX);
    b.malloc(MIB).unwrap();
    assert_eq!(b.stats().reserved_peak, 2 * MIB);
    b.malloc(MIB + 1).unwrap();
    assert_eq!(b.stats().reserved_peak, 22 * MIB);
    // Three 6 MiB requests share one 20 MiB segment (the rest after each split is
    // more than 1 MiB); the fourth does not fit in the 2 MiB left.
    let mut c = Allocator::new(AllocConf::default(), u64::MAX);
    alloc_all(&mut c, &[6 * MIB; 3]);
    assert_eq!(c.stats().reserved_peak, 20 * MIB);
    c.malloc(6 * MIB).unwrap();
    assert_eq!(c.stats().reserved_peak, 40 * MIB);
}

#[test]
fn freed_neighbours_merge_and_best_fit_picks_the_smallest() {
    let mut a = Allocator::new(AllocConf::default(), u64::MAX);
    // One 20 MiB segment split into 4 + 4 + 4 + 8 (rest).
    let b = alloc_all(&mut a, &[4 * MIB; 3]);
    a.free(b[0]);
    a.free(b[1]);
    // Freed neighbours merged into 8 MiB: a 7 MiB request fits there (and the
    // rest, 1 MiB, is not split off), no new segment.
    let x = a.malloc(7 * MIB).unwrap();
    assert_eq!(a.stats().reserved_peak, 20 * MIB);
    assert_eq!(a.block_size(x), 8 * MIB);
    // Best fit: 3 MiB goes to the 8 MiB tail... which is the only free block left.
    a.malloc(3 * MIB).unwrap();
    assert_eq!(a.stats().reserved_peak, 20 * MIB);
}

#[test]
fn a_full_device_releases_the_cache_then_fails() {
    // 64 MiB device: four 16 MiB segments, freed; a 32 MiB request does not fit
    // beside them, so the cache is released and the request succeeds.
    let mut a = Allocator::new(AllocConf::default(), 64 * MIB);
    for b in alloc_all(&mut a, &[16 * MIB; 4]) {
        a.free(b);
    }
    a.malloc(32 * MIB).unwrap();
    assert_eq!(a.stats().reserved, 32 * MIB);
    assert_eq!(a.stats().releases, 4);
    // Live 32 + 32 MiB leave nothing for another 2 MiB segment.
    a.malloc(32 * MIB).unwrap();
    let err = a.malloc(MIB).unwrap_err();
    assert_eq!(err.requested, MIB);
    assert_eq!(err.reserved, 64 * MIB);
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    // With max_split_size_mb:64, a cached 100 MiB segment does not serve a 30 MiB
    // request (oversize blocks serve only requests within 20 MiB of their size).
    let c = conf("max_split_size_mb:64");
    let mut a = Allocator::new(c.clone(), u64::MAX);
    let b = a.malloc(100 * MIB).unwrap();
    a.free(b);
    a.malloc(30 * MIB).unwrap();
    assert_eq!(a.stats().reserved_peak, 130 * MIB);
    // ... but serves an 85 MiB one whole.
    let mut d = Allocator::new(c, u64::MAX);
    let b = d.malloc(100 * MIB).unwrap();
    d.free(b);
    let x = d.malloc(85 * MIB).unwrap();
    assert_eq!(d.block_size(x), 100 * MIB);
    assert_eq!(d.stats().reserved_peak, 100 * MIB);
    // Without the option the 100 MiB segment is split for the 30 MiB request.
    let mut e = Allocator::new(AllocConf::default(), u64::MAX);
    let b = e.malloc(100 * MIB).unwrap();
    e.free(b);
    e.malloc(30 * MIB).unwrap();
    assert_eq!(e.stats().reserved_peak, 100 * MIB);
}

#[test]
fn expandable_segments_unmap_free_pages_when_full() {
    // 100 MiB device, expandable: 4 · 20 MiB mapped, the first three freed; a
    // 60 MiB request fits in the freed pages without mapping more.
    let mut a = Allocator::new(conf("expandable_segments:True"), 100 * MIB);
    let b = alloc_all(&mut a, &[20 * MIB; 4]);
    assert_eq!(a.stats().reserved_peak, 80 * MIB);
    for &x in &b[..3] {
        a.free(x);
    }
    a.malloc(60 * MIB).unwrap();
    assert_eq!(a.stats().reserved_peak, 80 * MIB);
    a.free(b[3]);
    // 60 MiB live at the segment's start; 40 MiB more maps 2 pages: 100 MiB, full.
    a.malloc(40 * MIB).unwrap();
    assert_eq!(a.stats().reserved, 100 * MIB);
}

#[test]
fn power2_divisions_round_requests() {
    // 1.2 GiB with 4 divisions between 1 and 2 GiB rounds to 1.25 GiB.
    let c = conf("roundup_power2_divisions:4");
    let mut a = Allocator::new(c, u64::MAX);
    let x = a.malloc(1200 * MIB).unwrap();
    assert_eq!(a.block_size(x), 1280 * MIB);
    assert_eq!(a.stats().reserved_peak, 1280 * MIB);
}
