//! Sizes as people read and write them: bytes printed with 1024-based units
//! (`1.50 KiB`, `44.59 MiB`), FLOPs with SI prefixes, and memory sizes parsed from
//! `16GiB`-style text. Every layer formats and parses sizes here.

/// Formats bytes with 1024-based units: `512 B`, `1.50 KiB`, `44.59 MiB`, `1.20 GiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

/// Formats a FLOP count with SI prefixes (`1.82 GFLOP`).
pub fn human_flops(f: u64) -> String {
    const UNITS: [&str; 6] = ["FLOP", "KFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"];
    let mut v = f as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{f} FLOP")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Parses a memory size: `16GiB`, `1.5 TiB`, `800MiB`, `16GB` (10⁹), `16G` (GiB),
/// or plain bytes.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("'{text}': expected a size such as 16GiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "p" | "pib" => 1024f64.powi(5),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "pb" => 1e15,
        u => return Err(format!("'{text}': unknown unit '{u}'")),
    };
    let bytes = v * mult;
    if bytes.is_nan() || !(1.0..=1e18).contains(&bytes) {
        return Err(format!("'{text}' must be between 1 byte and 1 EB"));
    }
    Ok(bytes as u64)
}

/// Parses a rate per second: a number of at least 1 with an optional SI prefix
/// (`94G`, `1.7T`, `9.4e10`; k, M, G, T are powers of 1000, and k, g, t may be
/// lowercase; m is not taken, it would read as milli).
pub fn parse_rate(text: &str) -> std::result::Result<f64, String> {
    let t = text.trim();
    let expected = || format!("'{text}': expected a rate per second such as 94G");
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() && t[..i].trim().parse::<f64>().is_ok() => {
            let mult = match c {
                'k' | 'K' => 1e3,
                'M' => 1e6,
                'G' | 'g' => 1e9,
                'T' | 't' => 1e12,
                _ => return Err(format!("'{text}': unknown prefix '{c}' (k, M, G or T)")),
            };
            (&t[..i], mult)
        }
        _ => (t, 1.0),
    };
    let v: f64 = num.trim().parse().map_err(|_| expected())?;
    let rate = v * mult;
    if !(rate.is_finite() && rate >= 1.0) {
        return Err(format!(
            "'{text}': a rate must be a number of at least 1 per second"
        ));
    }
    Ok(rate)
}

#[cfg(test)]
mod tests {
    use super::{parse_rate, parse_size};

    #[test]
    fn sizes() {
        for (text, want) in [
            ("16GiB", 16u64 << 30),
            ("1.5 TiB", 3 << 39),
            ("2PiB", 2 << 50),
            ("1p", 1 << 50),
            ("3PB", 3_000_000_000_000_000),
            ("16GB", 16_000_000_000),
            ("800", 800),
        ] {
            assert_eq!(parse_size(text), Ok(want), "{text}");
        }
        assert!(parse_size("2EiB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("0B").unwrap_err().contains("between 1 byte"));
    }

    #[test]
    fn rates() {
        for (text, want) in [
            ("94G", 94e9),
            (" 1.5 T ", 1.5e12),
            ("27g", 27e9),
            ("9.4e10", 9.4e10),
            ("1e9", 1e9),
            ("250k", 250e3),
            ("3M", 3e6),
        ] {
            assert_eq!(parse_rate(text), Ok(want), "{text}");
        }
        for (text, needle) in [
            ("0", "at least 1"),
            ("1e-300", "at least 1"),
            ("-5G", "at least 1"),
            ("inf", "at least 1"),
            ("NaN", "at least 1"),
            ("5m", "unknown prefix 'm'"),
            ("1.5e", "unknown prefix 'e'"),
            ("fast", "rate per second"),
            ("", "rate per second"),
        ] {
            let e = parse_rate(text).unwrap_err();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
}
