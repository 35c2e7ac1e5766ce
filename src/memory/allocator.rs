//! PyTorch's CUDA caching allocator, simulated: what `torch.cuda.max_memory_reserved`
//! and nvidia-smi show for a sequence of tensor allocations and frees, where
//! [`super::simulate`] counts only the live tensor bytes.
//!
//! The rules follow c10/cuda/CUDACachingAllocator.cpp (`DeviceCachingAllocator`) and
//! c10/core/AllocatorConfig.cpp, one stream, no CUDA graphs:
//!
//! - a request is rounded up to 512 B (`round_size`), or to the next power-of-two
//!   division when `roundup_power2_divisions` asks for it;
//! - rounded requests up to 1 MiB come from the small pool, whose segments are 2 MiB;
//!   larger ones from the large pool, whose segments are 20 MiB for requests under
//!   10 MiB and the request rounded up to 2 MiB otherwise (`get_allocation_size`);
//! - the cached free block chosen is the smallest that fits, lowest address first
//!   (`get_free_block`); with `max_split_size_mb`, blocks at or above that size serve
//!   only requests at or above it, and only within `max_non_split_rounding_mb`
//!   (20 MiB by default) of their size;
//! - a block is split when the rest is at least 512 B (small pool, or expandable
//!   segments) or more than 1 MiB (large pool, request under `max_split_size`)
//!   (`should_split`); a freed block merges with free neighbours of its segment;
//! - when no cached block fits, a new segment is allocated (`cudaMalloc`). When the
//!   device is full, cached oversize blocks are released first (with
//!   `max_split_size_mb`), then every unsplit cached segment, and the allocation is
//!   tried again; if that fails too it is an out-of-memory error
//!   ([`Allocator::malloc`]);
//! - with `expandable_segments:True`, each pool has one segment of virtual address
//!   space mapped in pages (2 MiB small, 20 MiB large) as it grows: a request that no
//!   free block fits maps just enough pages at the lowest address where free and
//!   unmapped space together fit it (`try_allocate_expandable_block`), and releasing
//!   the cache unmaps the wholly free pages.
//!
//! `allocated` counts blocks at their rounded size, as `torch.cuda.memory_allocated`
//! does; `reserved` counts segments (mapped pages), as `torch.cuda.memory_reserved`.
//! Segments get increasing addresses; a real `cudaMalloc` may reuse a released
//! range at a lower address, which only changes which of two equal-sized free blocks
//! is picked.

use std::collections::BTreeSet;

/// All sizes are rounded up to a multiple of this.
pub const MIN_BLOCK: u64 = 512;
/// Largest request served by the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`]; page size of large
/// expandable segments.
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Requests from here up get a segment of their own size (rounded to
/// [`ROUND_LARGE`]).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Rounding of large segments.
pub const ROUND_LARGE: u64 = 2 << 20;
const MIB: u64 = 1 << 20;
/// `roundup_power2_divisions` has one entry per power of two from 1 MiB to 64 GiB.
const POW2_INTERVALS: usize = 16;

/// How the allocator is set up (`expandable_segments`), as a named choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocatorKind {
    /// One `cudaMalloc` segment per block of segments (PyTorch's default).
    Default,
    /// `expandable_segments:True`: one growing segment per pool.
    Expandable,
}

crate::choice::choice!(AllocatorKind {
    Default => "default", "PyTorch's default: a cudaMalloc per segment (20 MiB, 2 MiB, or the request)";
    Expandable => "expandable", "expandable_segments:True: one segment per pool, mapped in pages as it grows";
});

/// The allocator's settings, as `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`)
/// gives them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllocConf {
    /// `max_split_size_mb`, in bytes (`u64::MAX`: unlimited, the default).
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb`, in bytes.
    pub max_non_split_rounding: u64,
    /// `roundup_power2_divisions` per size interval (0: plain 512 B rounding).
    pub roundup_power2_divisions: [u64; POW2_INTERVALS],
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `garbage_collection_threshold` (acts only under a per-process memory
    /// fraction, which is not modelled, as in PyTorch without one).
    pub garbage_collection_threshold: f64,
}

impl Default for AllocConf {
    fn default() -> Self {
        AllocConf {
            max_split_size: u64::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            roundup_power2_divisions: [0; POW2_INTERVALS],
            expandable_segments: false,
            garbage_collection_threshold: 0.0,
        }
    }
}

/// Splits `text` into PyTorch's config tokens: words and the single characters
/// `, : [ ]` (spaces dropped).
fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        if matches!(c, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            out.push(c.to_string());
        } else if c != ' ' {
            word.push(c);
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

impl AllocConf {
    /// Parses `PYTORCH_CUDA_ALLOC_CONF` syntax, e.g.
    /// `expandable_segments:True,max_split_size_mb:128` or
    /// `roundup_power2_divisions:[256:1,512:2,>:8]`. Options that do not change
    /// device memory (pinned-memory settings, `release_lock_on_cudamalloc`) are
    /// accepted; `backend:cudaMallocAsync` and unknown keys are errors.
    pub fn parse(text: &str) -> Result<AllocConf, String> {
        let t = tokens(text);
        let mut c = AllocConf::default();
        let mut i = 0;
        let value = |i: usize, key: &str| -> Result<&str, String> {
            if t.get(i).map(String::as_str) != Some(":") {
                return Err(format!("'{key}' needs a value ('{key}:VALUE')"));
            }
            match t.get(i + 1).map(String::as_str) {
                Some(v) if !matches!(v, "," | ":" | "[" | "]") => Ok(v),
                Some("[") if key == "roundup_power2_divisions" => Ok("["),
                _ => Err(format!("'{key}' needs a value ('{key}:VALUE')")),
            }
        };
        let int = |v: &str, key: &str| -> Result<u64, String> {
            v.parse::<u64>()
                .map_err(|_| format!("'{key}': '{v}' is not a non-negative integer"))
        };
        let boolean = |v: &str, key: &str| -> Result<bool, String> {
            match v {
                "True" => Ok(true),
                "False" => Ok(false),
                _ => Err(format!("'{key}': expected True or False, not '{v}'")),
            }
        };
        while i < t.len() {
            let key = t[i].as_str();
            let v = value(i + 1, key)?;
            i += 3;
            match key {
                "max_split_size_mb" | "max_non_split_rounding_mb" => {
                    let mb = int(v, key)?;
                    if mb < LARGE_BUFFER / MIB {
                        return Err(format!(
                            "'{key}' must be at least {} (MiB), as in PyTorch",
                            LARGE_BUFFER / MIB
                        ));
                    }
                    let bytes = mb.min(u64::MAX / MIB) * MIB;
                    if key == "max_split_size_mb" {
                        c.max_split_size = bytes;
                    } else {
                        c.max_non_split_rounding = bytes;
                    }
                }
                "expandable_segments" => c.expandable_segments = boolean(v, key)?,
                "garbage_collection_threshold" => {
                    let g: f64 = v
                        .parse()
                        .map_err(|_| format!("'{key}': '{v}' is not a number"))?;
                    if !(g > 0.0 && g < 1.0) {
                        return Err(format!("'{key}' must be between 0 and 1"));
                    }
                    c.garbage_collection_threshold = g;
                }
                "roundup_power2_divisions" => {
                    if v == "[" {
                        i = c.parse_divisions_list(&t, i)?;
                    } else {
                        let d = int(v, key)?;
                        if !d.is_power_of_two() {
                            return Err(format!("'{key}': {d} divisions is not a power of 2"));
                        }
                        c.roundup_power2_divisions = [d; POW2_INTERVALS];
                    }
                }
                "backend" => {
                    if v != "native" {
                        return Err(format!(
                            "'backend:{v}' is not modelled: only the native caching allocator is"
                        ));
                    }
                }
                "release_lock_on_cudamalloc"
                | "pinned_use_cuda_host_register"
                | "pinned_use_host_register"
                | "pinned_use_background_threads" => {
                    boolean(v, key)?;
                }
                "pinned_num_register_threads" => {
                    int(v, key)?;
                }
                _ => {
                    return Err(format!(
                        "unknown allocator option '{key}' (known: max_split_size_mb, \
                         max_non_split_rounding_mb, roundup_power2_divisions, \
                         expandable_segments, garbage_collection_threshold)"
                    ))
                }
            }
            match t.get(i).map(String::as_str) {
                None => {}
                Some(",") => i += 1,
                Some(other) => return Err(format!("expected ',' before '{other}'")),
            }
        }
        Ok(c)
    }

    /// `roundup_power2_divisions:[256:1,512:2,>:8]` from the `[` at `t[i - 1]`;
    /// returns the index after the `]`. Keys are sizes in MiB (powers of two), `>`
    /// every interval above the last one given; the first entry also covers every
    /// interval below it.
    fn parse_divisions_list(&mut self, t: &[String], mut i: usize) -> Result<usize, String> {
        const KEY: &str = "roundup_power2_divisions";
        let mut first = true;
        let mut last = 0usize;
        loop {
            let bound = t
                .get(i)
                .ok_or_else(|| format!("'{KEY}': missing ']'"))?
                .as_str();
            if bound == "]" {
                return Ok(i + 1);
            }
            if t.get(i + 1).map(String::as_str) != Some(":") {
                return Err(format!("'{KEY}': expected 'SIZE_MB:DIVISIONS' in the list"));
            }
            let d: u64 = t.get(i + 2).and_then(|v| v.parse().ok()).ok_or_else(|| {
                format!("'{KEY}': expected a number of divisions after '{bound}:'")
            })?;
            if d != 0 && !d.is_power_of_two() {
                return Err(format!("'{KEY}': {d} divisions is not a power of 2 (or 0)"));
            }
            if bound == ">" {
                for x in &mut self.roundup_power2_divisions[(last + 1).min(POW2_INTERVALS)..] {
                    *x = d;
                }
            } else {
                let mb: u64 = bound
                    .parse()
                    .map_err(|_| format!("'{KEY}': '{bound}' is not a size in MiB"))?;
                if !mb.is_power_of_two() {
                    return Err(format!("'{KEY}': the interval {mb} is not a power of 2"));
                }
                let index = (mb.ilog2() as usize).min(POW2_INTERVALS - 1);
                if first {
                    for x in &mut self.roundup_power2_divisions[..index] {
                        *x = d;
                    }
                    first = false;
                }
                self.roundup_power2_divisions[index] = d;
                last = index;
            }
            i += 3;
            match t.get(i).map(String::as_str) {
                Some(",") => i += 1,
                Some("]") => {}
                _ => return Err(format!("'{KEY}': missing ']'")),
            }
        }
    }

    /// These settings with the allocator set up as `kind` says (`expandable`
    /// turns `expandable_segments` on); an error when `kind` is `default` and the
    /// settings turn them on.
    pub fn with_kind(mut self, kind: AllocatorKind) -> Result<AllocConf, String> {
        match kind {
            AllocatorKind::Default if self.expandable_segments => Err(
                "the allocator 'default' contradicts expandable_segments:True in the settings"
                    .to_string(),
            ),
            AllocatorKind::Default => Ok(self),
            AllocatorKind::Expandable => {
                self.expandable_segments = true;
                Ok(self)
            }
        }
    }

    /// The divisions that apply to a request of `size` bytes.
    fn divisions(&self, size: u64) -> u64 {
        let log = size.max(1).ilog2() as usize;
        let start = MIB.ilog2() as usize;
        let index = log.saturating_sub(start).min(POW2_INTERVALS - 1);
        self.roundup_power2_divisions[index]
    }

    /// A request's size as the allocator rounds it (`round_size`).
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK {
            return MIN_BLOCK;
        }
        let d = self.divisions(size);
        // (A product past 64 bits is above every size: plain rounding.)
        if d > 1 && MIN_BLOCK.checked_mul(d).is_some_and(|m| size > m) {
            return roundup_power2_next_division(size, d);
        }
        size.div_ceil(MIN_BLOCK) * MIN_BLOCK
    }
}

/// `size` rounded up to the next of `divisions` equal steps between the powers of
/// two around it (1200 with 4 divisions: 1280).
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size <= 4 || divisions <= 1 || size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << size.ilog2();
    let step = floor >> divisions.ilog2();
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down + step
    }
}

/// The segment size a new segment gets for a rounded request (`get_allocation_size`).
pub fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// A handle to an allocated block.
pub type BlockId = usize;

#[derive(Debug, Clone, Copy)]
struct Block {
    addr: u64,
    size: u64,
    small: bool,
    allocated: bool,
    /// Backed by memory (always, outside expandable segments).
    mapped: bool,
    /// Index into `Allocator::expandable` when in an expandable segment.
    expandable: Option<usize>,
    prev: Option<BlockId>,
    next: Option<BlockId>,
    live: bool,
}

/// One expandable segment: virtual space from `base`, mapped in pages of `page`
/// bytes (the blocks record which ranges are mapped).
#[derive(Debug, Clone)]
struct Expandable {
    base: u64,
    page: u64,
    mapped_pages: u64,
}

#[derive(Debug, Default, Clone)]
struct Pool {
    /// Cached free (mapped) blocks by (size, address).
    free: BTreeSet<(u64, u64, BlockId)>,
    /// Unmapped ranges of expandable segments by address.
    unmapped: BTreeSet<(u64, BlockId)>,
}

/// An allocation the device could not hold, even after releasing the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemory {
    /// The request, in bytes.
    pub requested: u64,
    /// Bytes in allocated blocks when it failed.
    pub allocated: u64,
    /// Bytes reserved when it failed.
    pub reserved: u64,
}

/// Counters, as `torch.cuda.memory_stats()` names them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// `allocated_bytes.all.current`.
    pub allocated: u64,
    /// `allocated_bytes.all.peak` (`max_memory_allocated`).
    pub allocated_peak: u64,
    /// `reserved_bytes.all.current`.
    pub reserved: u64,
    /// `reserved_bytes.all.peak` (`max_memory_reserved`).
    pub reserved_peak: u64,
    /// Segments now (`cudaMalloc`s, or expandable segments with mapped pages).
    pub segments: u64,
    /// Segments when `reserved` peaked.
    pub segments_at_peak: u64,
    /// Segments released and page ranges unmapped, to free memory for a request or
    /// by [`Allocator::empty_cache`] (`num_device_free`).
    pub releases: u64,
}

/// The simulated allocator of one device and one stream.
#[derive(Debug, Clone)]
pub struct Allocator {
    conf: AllocConf,
    /// Bytes the allocator may reserve (device memory less the CUDA context and
    /// anything else outside it).
    capacity: u64,
    blocks: Vec<Block>,
    spare: Vec<BlockId>,
    pools: [Pool; 2],
    expandable: Vec<Expandable>,
    next_addr: u64,
    stats: AllocStats,
}

impl Allocator {
    /// An empty allocator that may reserve at most `capacity` bytes.
    pub fn new(conf: AllocConf, capacity: u64) -> Allocator {
        Allocator {
            conf,
            capacity,
            blocks: Vec::new(),
            spare: Vec::new(),
            pools: [Pool::default(), Pool::default()],
            expandable: Vec::new(),
            next_addr: 1 << 32,
            stats: AllocStats::default(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> AllocStats {
        self.stats
    }

    /// The size a live block occupies.
    pub fn block_size(&self, b: BlockId) -> u64 {
        self.blocks[b].size
    }

    fn pool(&mut self, small: bool) -> &mut Pool {
        &mut self.pools[small as usize]
    }

    fn new_block(&mut self, b: Block) -> BlockId {
        if let Some(id) = self.spare.pop() {
            self.blocks[id] = b;
            id
        } else {
            self.blocks.push(b);
            self.blocks.len() - 1
        }
    }

    fn drop_block(&mut self, id: BlockId) {
        self.blocks[id].live = false;
        self.spare.push(id);
    }

    fn insert_free(&mut self, id: BlockId) {
        let (size, addr, small) = {
            let b = &self.blocks[id];
            (b.size, b.addr, b.small)
        };
        self.pool(small).free.insert((size, addr, id));
    }

    fn remove_free(&mut self, id: BlockId) {
        let (size, addr, small) = {
            let b = &self.blocks[id];
            (b.size, b.addr, b.small)
        };
        self.pool(small).free.remove(&(size, addr, id));
    }

    fn set_reserved(&mut self, reserved: u64) {
        self.stats.reserved = reserved;
        if reserved > self.stats.reserved_peak {
            self.stats.reserved_peak = reserved;
            self.stats.segments_at_peak = self.stats.segments;
        }
    }

    /// Allocates `size` bytes; the block's size is the rounded request.
    pub fn malloc(&mut self, size: u64) -> Result<BlockId, OutOfMemory> {
        let size = self.conf.round_size(size);
        let small = size <= SMALL_SIZE;
        let mut found = self.free_block(small, size);
        if found.is_none() {
            found = self.alloc_block(small, size);
        }
        if found.is_none() && self.release_available(small, size) {
            found = self.alloc_block(small, size);
        }
        if found.is_none() {
            self.release_cached();
            found = self.alloc_block(small, size);
        }
        let Some(id) = found else {
            return Err(OutOfMemory {
                requested: size,
                allocated: self.stats.allocated,
                reserved: self.stats.reserved,
            });
        };
        let id = if self.should_split(id, size) {
            self.split(id, size)
        } else {
            id
        };
        self.blocks[id].allocated = true;
        self.stats.allocated += self.blocks[id].size;
        self.stats.allocated_peak = self.stats.allocated_peak.max(self.stats.allocated);
        Ok(id)
    }

    /// Frees a block: it merges with free neighbours and is cached.
    pub fn free(&mut self, id: BlockId) {
        assert!(
            self.blocks[id].live && self.blocks[id].allocated,
            "free of a block that is not allocated"
        );
        self.blocks[id].allocated = false;
        self.stats.allocated -= self.blocks[id].size;
        let (prev, next) = (self.blocks[id].prev, self.blocks[id].next);
        self.try_merge(id, prev);
        self.try_merge(id, next);
        self.insert_free(id);
    }

    /// Releases every cached block that can be (`torch.cuda.empty_cache()`).
    pub fn empty_cache(&mut self) {
        self.release_cached();
    }

    /// `get_free_block`: the best-fitting cached block, taken out of the cache.
    fn free_block(&mut self, small: bool, size: u64) -> Option<BlockId> {
        let (max_split, rounding) = (self.conf.max_split_size, self.conf.max_non_split_rounding);
        let pool = &self.pools[small as usize];
        let mut it = pool.free.range((size, 0, 0)..);
        let mut cur = *it.next()?;
        if self.conf.expandable_segments && self.blocks[cur.2].expandable.is_some() {
            // A block that ends where unmapped space begins counts at the size it
            // could grow to, so a block that fits without growing is preferred.
            let grow = |id: BlockId| {
                let b = &self.blocks[id];
                b.size
                    + b.next
                        .filter(|&n| !self.blocks[n].mapped)
                        .map_or(0, |n| self.blocks[n].size)
            };
            for next in it {
                if self.blocks[cur.2].expandable.is_none() || grow(next.2) >= grow(cur.2) {
                    break;
                }
                cur = *next;
            }
        }
        let block = cur.0;
        if size < max_split && block >= max_split {
            return None;
        }
        if size >= max_split && block >= size.saturating_add(rounding) {
            return None;
        }
        self.pools[small as usize].free.remove(&cur);
        Some(cur.2)
    }

    fn should_split(&self, id: BlockId, size: u64) -> bool {
        let b = &self.blocks[id];
        let rest = b.size - size;
        if b.small || self.conf.expandable_segments {
            rest >= MIN_BLOCK
        } else {
            size < self.conf.max_split_size && rest > SMALL_SIZE
        }
    }

    /// Splits `size` bytes off the front of `id` (taken out of the cache); returns
    /// the front block, the rest goes back to the cache.
    fn split(&mut self, id: BlockId, size: u64) -> BlockId {
        let b = self.blocks[id];
        let front = self.new_block(Block {
            size,
            next: Some(id),
            allocated: false,
            ..b
        });
        if let Some(p) = b.prev {
            self.blocks[p].next = Some(front);
        }
        let rest = &mut self.blocks[id];
        rest.prev = Some(front);
        rest.addr += size;
        rest.size -= size;
        self.insert_free(id);
        front
    }

    /// `try_merge_blocks`: merges `src` into `dst` when `src` is free and in the
    /// same mapping state; `dst` is out of every set.
    fn try_merge(&mut self, dst: BlockId, src: Option<BlockId>) {
        let Some(src) = src else { return };
        let s = self.blocks[src];
        if s.allocated || s.mapped != self.blocks[dst].mapped {
            return;
        }
        if s.mapped {
            self.remove_free(src);
        } else {
            self.pools[s.small as usize].unmapped.remove(&(s.addr, src));
        }
        if self.blocks[dst].prev == Some(src) {
            self.blocks[dst].addr = s.addr;
            self.blocks[dst].prev = s.prev;
            if let Some(p) = s.prev {
                self.blocks[p].next = Some(dst);
            }
        } else {
            self.blocks[dst].next = s.next;
            if let Some(n) = s.next {
                self.blocks[n].prev = Some(dst);
            }
        }
        self.blocks[dst].size += s.size;
        self.drop_block(src);
    }

    /// `alloc_block`: a new segment (or newly mapped pages) for the request; the
    /// block is out of the cache.
    fn alloc_block(&mut self, small: bool, size: u64) -> Option<BlockId> {
        if self.conf.expandable_segments {
            return self.alloc_expandable(small, size);
        }
        let seg = allocation_size(size);
        if self.stats.reserved.saturating_add(seg) > self.capacity {
            return None;
        }
        let addr = self.next_addr;
        self.next_addr += seg.div_ceil(SMALL_BUFFER) * SMALL_BUFFER + SMALL_BUFFER;
        let id = self.new_block(Block {
            addr,
            size: seg,
            small,
            allocated: false,
            mapped: true,
            expandable: None,
            prev: None,
            next: None,
            live: true,
        });
        self.stats.segments += 1;
        self.set_reserved(self.stats.reserved + seg);
        Some(id)
    }

    /// `release_available_cached_blocks`: with `max_split_size`, frees the smallest
    /// cached oversize segment that fits the request, or the largest ones until
    /// their total does.
    fn release_available(&mut self, small: bool, size: u64) -> bool {
        if self.conf.max_split_size == u64::MAX || self.conf.expandable_segments {
            return false;
        }
        let key = size.max(self.conf.max_split_size);
        let pool = &self.pools[small as usize];
        if let Some(&(_, _, id)) = pool.free.range((key, 0, 0)..).next() {
            self.release_segment(id);
            return true;
        }
        let mut released = 0;
        let oversize: Vec<BlockId> = pool
            .free
            .iter()
            .rev()
            .take_while(|e| e.0 >= self.conf.max_split_size)
            .map(|e| e.2)
            .collect();
        for id in oversize {
            if released >= key {
                break;
            }
            released += self.blocks[id].size;
            self.release_segment(id);
        }
        released >= key
    }

    /// `release_cached_blocks`: frees every cached block that is a whole segment,
    /// and unmaps the wholly free pages of expandable segments.
    fn release_cached(&mut self) {
        for small in [false, true] {
            let cached: Vec<BlockId> = self.pools[small as usize]
                .free
                .iter()
                .map(|e| e.2)
                .collect();
            for id in cached {
                let b = &self.blocks[id];
                if b.expandable.is_some() {
                    self.unmap_block(id);
                } else if b.prev.is_none() && b.next.is_none() {
                    self.release_segment(id);
                }
            }
        }
    }

    /// `release_block`: `cudaFree` of a cached whole segment.
    fn release_segment(&mut self, id: BlockId) {
        self.remove_free(id);
        self.stats.segments -= 1;
        self.stats.releases += 1;
        self.set_reserved(self.stats.reserved - self.blocks[id].size);
        self.drop_block(id);
    }

    /// `find_expandable_block`: the lowest-addressed run of free and unmapped
    /// space of at least `size`, starting at a free block before an unmapped one,
    /// or a new segment's unmapped space.
    fn find_expandable(&mut self, small: bool, size: u64) -> BlockId {
        let free_from = |a: &Allocator, mut b: Option<BlockId>| {
            let mut bytes = 0;
            while let Some(id) = b {
                if bytes >= size || a.blocks[id].allocated {
                    break;
                }
                bytes += a.blocks[id].size;
                b = a.blocks[id].next;
            }
            bytes >= size
        };
        let found = self.pools[small as usize]
            .unmapped
            .iter()
            .find_map(|&(_, u)| {
                let start = match self.blocks[u].prev {
                    Some(p) if !self.blocks[p].allocated => p,
                    _ => u,
                };
                free_from(self, Some(start)).then_some(start)
            });
        if let Some(start) = found {
            return start;
        }
        let page = if small { SMALL_BUFFER } else { LARGE_BUFFER };
        // PyTorch reserves address space for 1 1/8 of the device's memory (here at
        // most 16 TiB: the capacity may be unlimited).
        let cap = self.capacity.min(1 << 44);
        let pages = (cap + cap / 8).div_ceil(page).max(1);
        let base = self.next_addr.div_ceil(page) * page;
        self.next_addr = base + pages * page + page;
        self.expandable.push(Expandable {
            base,
            page,
            mapped_pages: 0,
        });
        let id = self.new_block(Block {
            addr: base,
            size: pages * page,
            small,
            allocated: false,
            mapped: false,
            expandable: Some(self.expandable.len() - 1),
            prev: None,
            next: None,
            live: true,
        });
        self.pools[small as usize].unmapped.insert((base, id));
        id
    }

    /// `try_allocate_expandable_block`.
    fn alloc_expandable(&mut self, small: bool, size: u64) -> Option<BlockId> {
        let mut cand = self.find_expandable(small, size);
        if !self.blocks[cand].mapped {
            let n = self.blocks[cand].size.min(size);
            cand = self.map_block(cand, n)?;
        }
        while self.blocks[cand].size < size {
            let rest = size - self.blocks[cand].size;
            let next = self.blocks[cand].next.expect("space was found");
            let n = self.blocks[next].size.min(rest);
            cand = self.map_block(next, n)?;
        }
        self.remove_free(cand);
        Some(cand)
    }

    /// `map_block`: maps the pages under the first `size` bytes of unmapped block
    /// `id`, merges the mapped part with free neighbours and caches it; returns the
    /// merged block, or `None` when the device is full.
    fn map_block(&mut self, id: BlockId, size: u64) -> Option<BlockId> {
        let b = self.blocks[id];
        let es = &self.expandable[b.expandable.expect("expandable")];
        let page = es.page;
        let first = (b.addr - es.base) / page;
        let last = (b.addr + size - es.base).div_ceil(page);
        let bytes = (last - first) * page;
        if self.stats.reserved.saturating_add(bytes) > self.capacity {
            return None;
        }
        let es = &mut self.expandable[b.expandable.expect("expandable")];
        if es.mapped_pages == 0 {
            self.stats.segments += 1;
        }
        es.mapped_pages += last - first;
        self.pools[b.small as usize].unmapped.remove(&(b.addr, id));
        self.blocks[id].mapped = true;
        if bytes < b.size {
            let rest = self.new_block(Block {
                addr: b.addr + bytes,
                size: b.size - bytes,
                mapped: false,
                allocated: false,
                prev: Some(id),
                next: b.next,
                ..b
            });
            if let Some(n) = b.next {
                self.blocks[n].prev = Some(rest);
            }
            self.blocks[id].next = Some(rest);
            self.blocks[id].size = bytes;
            self.pools[b.small as usize]
                .unmapped
                .insert((b.addr + bytes, rest));
        }
        let (prev, next) = (self.blocks[id].prev, self.blocks[id].next);
        self.try_merge(id, prev);
        self.try_merge(id, next);
        self.insert_free(id);
        self.set_reserved(self.stats.reserved + bytes);
        Some(id)
    }

    /// `unmap_block`: unmaps the wholly free pages of cached block `id`.
    fn unmap_block(&mut self, id: BlockId) {
        let b = self.blocks[id];
        let e = b.expandable.expect("expandable");
        let (base, page) = (self.expandable[e].base, self.expandable[e].page);
        let first = (b.addr - base).div_ceil(page);
        let last = (b.addr + b.size - base) / page;
        if first >= last {
            return;
        }
        self.remove_free(id);
        let start = base + first * page;
        let bytes = (last - first) * page;
        let before = start - b.addr;
        if before > 0 {
            let f = self.new_block(Block {
                size: before,
                next: Some(id),
                ..b
            });
            if let Some(p) = b.prev {
                self.blocks[p].next = Some(f);
            }
            self.blocks[id].prev = Some(f);
            self.insert_free(f);
        }
        let after = b.size - before - bytes;
        if after > 0 {
            let a = self.new_block(Block {
                addr: start + bytes,
                size: after,
                prev: Some(id),
                next: b.next,
                ..b
            });
            if let Some(n) = b.next {
                self.blocks[n].prev = Some(a);
            }
            self.blocks[id].next = Some(a);
            self.insert_free(a);
        }
        let blk = &mut self.blocks[id];
        blk.addr = start;
        blk.size = bytes;
        blk.mapped = false;
        let (prev, next) = (blk.prev, blk.next);
        self.try_merge(id, prev);
        self.try_merge(id, next);
        let addr = self.blocks[id].addr;
        self.pools[b.small as usize].unmapped.insert((addr, id));
        let es = &mut self.expandable[e];
        es.mapped_pages -= last - first;
        if es.mapped_pages == 0 {
            self.stats.segments -= 1;
        }
        self.stats.releases += 1;
        self.set_reserved(self.stats.reserved - bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_follows_round_size() {
        let c = AllocConf::default();
        assert_eq!(c.round_size(1), 512);
        assert_eq!(c.round_size(513), 1024);
        assert_eq!(c.round_size(1200), 1536);
        let c4 = AllocConf::parse("roundup_power2_divisions:4").unwrap();
        // Between 1024 and 2048 in four steps: 1024, 1280, 1536, 1792.
        assert_eq!(roundup_power2_next_division(1200, 4), 1280);
        assert_eq!(c4.round_size(1200), 1536); // 1200 <= 512 * 4: plain rounding
        assert_eq!(c4.round_size(5 * MIB + 1), 5 * MIB + MIB);
        assert_eq!(c4.round_size(8 * MIB), 8 * MIB);
    }

    #[test]
    fn conf_parses_pytorch_syntax() {
        let c = AllocConf::parse(
            "expandable_segments:True, max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:8]",
        )
        .unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, 128 * MIB);
        let mut want = [1u64; POW2_INTERVALS];
        want[9] = 2;
        for w in &mut want[10..] {
            *w = 8;
        }
        assert_eq!(c.roundup_power2_divisions, want);
        for bad in [
            "max_split_size_mb:10",
            "expandable_segments:maybe",
            "expandable_segments:true",
            "bogus:1",
            "backend:cudaMallocAsync",
            "roundup_power2_divisions:3",
            "roundup_power2_divisions:[256:1",
            "max_split_size_mb",
        ] {
            assert!(AllocConf::parse(bad).is_err(), "{bad} was accepted");
        }
        assert_eq!(AllocConf::parse("").unwrap(), AllocConf::default());
    }
}
