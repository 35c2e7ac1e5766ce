//! The CUDA C sources of kernels/ embedded in the binary (always compiled, so
//! the op table's kernel names are checked against them without the `cuda`
//! feature). The GPU backend ([`crate::exec::cuda`], feature `cuda`) compiles
//! them with NVRTC at first use.

/// Prepended to every source before compiling (NVRTC gets no include path).
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// One `kernels/*.cu` file.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    /// File name under kernels/.
    pub file: &'static str,
    /// Its text (without [`COMMON`]).
    pub code: &'static str,
    /// Code generated from the op tables, put where the line [`GENERATED_MARK`] stands.
    pub generated: Option<fn() -> String>,
}

/// The line of a kernels/ source that its [`Source::generated`] code replaces.
pub const GENERATED_MARK: &str = "// @op-tables";

/// Every kernel source, in a fixed order.
pub const SOURCES: &[Source] = &[
    Source {
        file: "elementwise.cu",
        code: include_str!("../../kernels/elementwise.cu"),
        generated: Some(crate::ops::elementwise::cuda_switches),
    },
    Source {
        file: "reduce.cu",
        code: include_str!("../../kernels/reduce.cu"),
        generated: None,
    },
    Source {
        file: "softmax.cu",
        code: include_str!("../../kernels/softmax.cu"),
        generated: None,
    },
    Source {
        file: "norm.cu",
        code: include_str!("../../kernels/norm.cu"),
        generated: None,
    },
    Source {
        file: "pool.cu",
        code: include_str!("../../kernels/pool.cu"),
        generated: None,
    },
    Source {
        file: "conv.cu",
        code: include_str!("../../kernels/conv.cu"),
        generated: None,
    },
    Source {
        file: "shape.cu",
        code: include_str!("../../kernels/shape.cu"),
        generated: None,
    },
    Source {
        file: "half.cu",
        code: include_str!("../../kernels/half.cu"),
        generated: None,
    },
];

impl Source {
    /// The program NVRTC compiles: [`COMMON`] then the file.
    pub fn program(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}\"\n{}", self.file, self.text())
    }

    /// The file's text with its generated code in place.
    pub fn text(&self) -> String {
        match self.generated {
            Some(g) => self.code.replacen(GENERATED_MARK, &g(), 1),
            None => self.code.to_string(),
        }
    }

    /// Names of the kernels the file defines: every `extern "C" __global__ void
    /// NAME(` line, and the instances `MP_MACRO(NAME, T)` of kernel-defining
    /// macros (whose own body lines end with `\` and are skipped).
    pub fn kernels(&self) -> Vec<&'static str> {
        const ENTRY: &str = "extern \"C\" __global__ void ";
        let mut v = Vec::new();
        for line in self.code.lines() {
            // Macro bodies (lines continued with `\`) are templates, not kernels.
            if line.trim_end().ends_with('\\') {
                continue;
            }
            if let Some(rest) = line.strip_prefix(ENTRY) {
                if let Some(end) = rest.find('(') {
                    v.push(rest[..end].trim());
                }
            } else if let Some(rest) = line.strip_prefix("MP_") {
                // A kernel-defining macro's instance: `MP_SOMETHING(NAME, T)`.
                if let Some((mac, args)) = rest.split_once('(') {
                    if mac.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                        if let Some(end) = args.find(',') {
                            v.push(args[..end].trim());
                        }
                    }
                }
            }
        }
        v
    }
}

/// The source that defines `kernel`, if any.
pub fn source_of(kernel: &str) -> Option<&'static Source> {
    SOURCES.iter().find(|s| s.kernels().contains(&kernel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::registry;

    #[test]
    fn kernel_names_are_unique_and_found() {
        let mut all: Vec<&str> = SOURCES.iter().flat_map(|s| s.kernels()).collect();
        assert!(all.contains(&"unary_fwd_f32"));
        assert!(all.contains(&"strided_copy_b4"));
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "a kernel name is defined twice");
    }

    #[test]
    fn generated_code_has_its_place() {
        for src in SOURCES {
            let marks = src.code.matches(GENERATED_MARK).count();
            assert_eq!(marks, src.generated.is_some() as usize, "{}", src.file);
            assert!(!src.text().contains(GENERATED_MARK), "{}", src.file);
        }
        let text = SOURCES[0].text();
        assert!(text.contains("float mp_unary(int op"));
        assert!(text.contains("float mp_unary_d(int op"));
        assert!(text.contains("float mp_binary(int op"));
        assert!(text.contains("float mp_binary_d(int op"));
        assert!(text.contains("bool mp_compare(int op"));
    }

    #[test]
    fn every_op_kernel_is_defined() {
        let reg = registry();
        for name in reg.names() {
            let k = reg.get("", name).unwrap().cuda_kernels(name);
            for kernel in k.forward.iter().chain(k.backward) {
                if *kernel == crate::ops::CUBLAS_SGEMM {
                    continue;
                }
                assert!(
                    source_of(kernel).is_some(),
                    "{name} lists CUDA kernel {kernel}, which no kernels/*.cu defines"
                );
            }
        }
    }
}
