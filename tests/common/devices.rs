//! The devices the CUDA tests run on: a GPU, or the host emulation of kernels/.
#![cfg(feature = "cuda")]

use memplan::exec::cuda::Device;
use memplan::exec::Tensor;

/// One test body on both devices, as candle's `test_device!`: `$gpu` runs it on a
/// GPU (skipped, with the reason, where none is usable) and `$emu` on the host
/// emulation of kernels/ ([`emulated`]). Attributes given first (`#[ignore]`) apply
/// to both.
#[macro_export]
macro_rules! device_test {
    ($(#[$attr:meta])* $body:ident: $gpu:ident, $emu:ident) => {
        $(#[$attr])*
        #[test]
        fn $gpu() {
            if let Some(dev) = $crate::common::devices::device(stringify!($gpu)) {
                $body(&dev);
            }
        }

        $(#[$attr])*
        #[test]
        fn $emu() {
            if let Some(dev) = $crate::common::devices::emulated(stringify!($emu)) {
                $body(&dev);
            }
        }
    };
}

/// The device, or why there is none (printed).
pub fn device(test: &str) -> Option<Device> {
    match Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIP {test}: no usable GPU: {e}");
            None
        }
    }
}

/// The host emulation built with `$MEMPLAN_CXX` (default `c++`), or `None` with the
/// reason printed; with `MEMPLAN_REQUIRE_CXX=1` (CI) a missing compiler fails.
pub fn emulated(test: &str) -> Option<Device> {
    let cxx = std::env::var("MEMPLAN_CXX").unwrap_or_else(|_| "c++".into());
    if std::process::Command::new(&cxx)
        .arg("--version")
        .output()
        .is_err()
    {
        let required = std::env::var("MEMPLAN_REQUIRE_CXX").is_ok_and(|v| v == "1");
        assert!(!required, "MEMPLAN_REQUIRE_CXX=1 but {cxx} cannot run");
        eprintln!("SKIP {test}: no C++ compiler ({cxx}) for the host emulation");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let emu = memplan::exec::cuda::emulate::Emulator::build(dir.path(), &cxx)
        .unwrap_or_else(|e| panic!("{e}"));
    Some(Device::emulated(emu))
}

/// `max|got − want| ≤ 1e-4 · max|want|` for floats, equality otherwise.
pub fn agree(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(
        (got.dtype(), &got.shape),
        (want.dtype(), &want.shape),
        "{what}: dtype and shape"
    );
    if !want.dtype().is_float() {
        assert_eq!(got.to_i64s(), want.to_i64s(), "{what}");
        return;
    }
    let (g, w) = (got.to_f32().unwrap(), want.to_f32().unwrap());
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let (mut worst, mut at) = (0f32, 0);
    for (i, (&a, &b)) in g.iter().zip(w.iter()).enumerate() {
        let d = match (a.is_nan(), b.is_nan()) {
            (true, true) => 0.0,
            (false, false) => (a - b).abs(),
            _ => f32::INFINITY,
        };
        if d > worst {
            (worst, at) = (d, i);
        }
    }
    assert!(
        worst <= 1e-4 * scale,
        "{what}: element {at}: gpu {} cpu {} (max|cpu| {scale})",
        g[at],
        w[at]
    );
}
