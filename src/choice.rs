//! Named choices (optimizer, precision, loss, solver): every variant's name, spelled
//! as the command line, the JSON and the rewrite metadata spell it, and its one-line
//! description. The library's own table; the command line builds its flags from it
//! (the library knows no command-line parser).

/// An enum of named choices ([`choice!`] implements it).
pub trait Choice: Copy + PartialEq + Send + Sync + 'static {
    /// Every variant, in order.
    const ALL: &'static [Self];
    /// Its name (`adamw`, `amp-bf16`).
    fn name(self) -> &'static str;
    /// One line on what it is.
    fn about(self) -> &'static str;
    /// The variant named `s`.
    fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.name() == s)
    }
    /// Every name, comma-separated (for messages).
    fn names() -> String {
        Self::ALL
            .iter()
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Implements [`Choice`], `Display` (the name) and `FromStr` (by name) for an enum:
/// `choice!(Optimizer { Sgd => "sgd", "Plain SGD: no state"; ... });`
macro_rules! choice {
    ($t:ident { $($v:ident => $name:literal, $about:literal;)* }) => {
        impl $crate::choice::Choice for $t {
            const ALL: &'static [Self] = &[$($t::$v),*];
            fn name(self) -> &'static str {
                match self {
                    $($t::$v => $name,)*
                }
            }
            fn about(self) -> &'static str {
                match self {
                    $($t::$v => $about,)*
                }
            }
        }
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str($crate::choice::Choice::name(*self))
            }
        }
        impl std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                <$t as $crate::choice::Choice>::parse(s).ok_or_else(|| {
                    format!(
                        "'{s}' is not one of {}",
                        <$t as $crate::choice::Choice>::names()
                    )
                })
            }
        }
    };
}
pub(crate) use choice;
