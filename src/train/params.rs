//! Which parameters train: `--freeze REGEX` and `--trainable REGEX` over the
//! parameters' PyTorch names ([`crate::ir::parameter_name`]). A frozen parameter is
//! what `requires_grad_(False)` makes it: no gradient, no optimizer state, and
//! backward runs only where a trainable parameter is upstream.

use regex::Regex;

use crate::error::{Error, Result, Setting};

/// A pattern as given and compiled.
#[derive(Debug, Clone)]
pub struct Pattern {
    text: String,
    re: Regex,
}

impl Pattern {
    /// Compiles `text` (Rust `regex` syntax, searched anywhere in the name as
    /// Python's `re.search` does); `setting` names the flag in the error.
    pub fn new(text: &str, setting: Setting) -> Result<Pattern> {
        let re = Regex::new(text).map_err(|e| {
            let first = e.to_string();
            let first = first.lines().last().unwrap_or_default().trim();
            let first = first.trim_start_matches("error: ").to_string();
            Error::setting(
                setting,
                format!("'{text}' is not a regular expression: {first}"),
            )
        })?;
        Ok(Pattern {
            text: text.to_string(),
            re,
        })
    }

    /// The pattern as given.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether the pattern occurs in `name`.
    pub fn is_match(&self, name: &str) -> bool {
        self.re.is_match(name)
    }
}

/// The parameters that train: all (the default), all but those `freeze` matches,
/// only those `trainable` matches, or both rules at once.
#[derive(Debug, Clone, Default)]
pub struct ParamSelection {
    /// Parameters matching this are frozen.
    pub freeze: Option<Pattern>,
    /// Only parameters matching this train.
    pub trainable: Option<Pattern>,
    /// How the frozen parameters are stored (`None`: as the precision stores
    /// parameters); see [`super::quant`].
    pub frozen_dtype: Option<super::quant::WeightDtype>,
}

impl ParamSelection {
    /// Every parameter trains.
    pub fn all() -> ParamSelection {
        ParamSelection::default()
    }

    /// From the flags' texts.
    pub fn new(freeze: Option<&str>, trainable: Option<&str>) -> Result<ParamSelection> {
        Ok(ParamSelection {
            freeze: freeze
                .map(|f| Pattern::new(f, Setting::Freeze))
                .transpose()?,
            trainable: trainable
                .map(|t| Pattern::new(t, Setting::Trainable))
                .transpose()?,
            frozen_dtype: None,
        })
    }

    /// Whether every parameter trains.
    pub fn is_all(&self) -> bool {
        self.freeze.is_none() && self.trainable.is_none()
    }

    /// Whether the parameter named `name` trains.
    pub fn trains(&self, name: &str) -> bool {
        self.trainable.as_ref().is_none_or(|p| p.is_match(name))
            && !self.freeze.as_ref().is_some_and(|p| p.is_match(name))
    }

    /// Which of the parameters `names` train, in order; an error when a pattern
    /// matches no parameter or when nothing is left to train.
    pub fn resolve(&self, names: &[String]) -> Result<Vec<bool>> {
        let example = || {
            names
                .iter()
                .take(2)
                .map(|n| format!("'{n}'"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        for (p, setting) in [
            (&self.freeze, Setting::Freeze),
            (&self.trainable, Setting::Trainable),
        ] {
            if let Some(p) = p {
                if !names.iter().any(|n| p.is_match(n)) {
                    return Err(Error::setting(
                        setting,
                        format!(
                            "'{}' matches none of the {} parameters (named like {})",
                            p.as_str(),
                            names.len(),
                            example()
                        ),
                    ));
                }
            }
        }
        let trains: Vec<bool> = names.iter().map(|n| self.trains(n)).collect();
        if !names.is_empty() && !trains.contains(&true) {
            let setting = if self.freeze.is_some() {
                Setting::Freeze
            } else {
                Setting::Trainable
            };
            return Err(Error::setting(
                setting,
                format!(
                    "it freezes all {} parameters: nothing is left to train",
                    names.len()
                ),
            ));
        }
        Ok(trains)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        [
            "conv1.weight",
            "layer1.0.conv1.weight",
            "fc.weight",
            "fc.bias",
        ]
        .map(String::from)
        .to_vec()
    }

    #[test]
    fn freeze_and_trainable() {
        let s = ParamSelection::new(Some("^layer1"), None).unwrap();
        assert_eq!(s.resolve(&names()).unwrap(), [true, false, true, true]);
        let s = ParamSelection::new(None, Some(r"^fc\.")).unwrap();
        assert_eq!(s.resolve(&names()).unwrap(), [false, false, true, true]);
        let s = ParamSelection::new(Some("bias"), Some(r"^fc\.")).unwrap();
        assert_eq!(s.resolve(&names()).unwrap(), [false, false, true, false]);
        assert!(ParamSelection::all()
            .resolve(&names())
            .unwrap()
            .iter()
            .all(|&t| t));
    }

    #[test]
    fn bad_patterns_say_why() {
        let e = ParamSelection::new(Some("lora_"), None)
            .unwrap()
            .resolve(&names())
            .unwrap_err()
            .to_string();
        assert!(e.contains("matches none of the 4 parameters"), "{e}");
        let e = ParamSelection::new(Some("."), None)
            .unwrap()
            .resolve(&names())
            .unwrap_err()
            .to_string();
        assert!(e.contains("nothing is left to train"), "{e}");
        let e = ParamSelection::new(None, Some("("))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular expression"), "{e}");
    }
}
