//! Links the C++ runtime once, statically where the C++ compiler has it, and links
//! the `memplan` executable at a fixed address.
//!
//! CBC (the MILP solver, compiled from its C++ sources by the `*-src` crates) needs
//! the C++ runtime. Left to themselves, those crates' `cc` builds each link
//! `libstdc++.so`, and a process then spends about 0.7 ms of its start in the
//! dynamic loader (loading it and resolving its symbols) before any work: more than
//! `memplan profile` spends on a ResNet-50. `.cargo/config.toml` sets `CXXSTDLIB`
//! to empty, which makes those builds link no C++ runtime, and this script links
//! `libstdc++.a` instead (`static:-bundle`: the final link finds it in the
//! compiler's library directory). A compiler without the static archive, or a
//! `CXXSTDLIB` the user sets, gets the runtime `cc` would have linked.
//!
//! On Linux the executable is also linked without position independence
//! (`-no-pie`): the loader then has no 20,000 relative relocations to apply at
//! every start. Measured: `memplan --version` 2.3 ms → 1.4 ms, `/bin/true` 0.75 ms.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CXXSTDLIB");
    println!("cargo:rerun-if-env-changed=CXX");
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let target_env = env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let linux_gnu = target_os == "linux" && target_env == "gnu";

    // A CXXSTDLIB that names a library: the `cc` builds link it themselves.
    let chosen = env::var("CXXSTDLIB").unwrap_or_default();
    if chosen.is_empty() {
        match linux_gnu.then(static_libstdcxx).flatten() {
            Some(dir) => {
                println!("cargo:rustc-link-search=native={}", dir.display());
                println!("cargo:rustc-link-lib=static:-bundle=stdc++");
            }
            None if target_os == "macos" || target_os == "ios" => {
                println!("cargo:rustc-link-lib=c++")
            }
            None if target_env != "msvc" => println!("cargo:rustc-link-lib=stdc++"),
            None => {}
        }
    }
    if linux_gnu {
        println!("cargo:rustc-link-arg-bins=-no-pie");
    }
}

/// The directory holding the C++ compiler's `libstdc++.a`, if it has one.
fn static_libstdcxx() -> Option<PathBuf> {
    let cxx = env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(cxx)
        .arg("-print-file-name=libstdc++.a")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    // Without the archive the compiler prints the bare name back.
    (out.status.success() && path.is_absolute() && path.is_file())
        .then(|| path.parent().map(PathBuf::from))
        .flatten()
}
