//! Kubernetes resource quantities, as Pod specs and fleet files write them.

/// Errors are a plain message naming what was wrong with the text.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid quantity {text:?}: {why}")]
pub struct QuantityError {
    pub text: String,
    pub why: &'static str,
}

fn err(text: &str, why: &'static str) -> QuantityError {
    QuantityError {
        text: text.to_owned(),
        why,
    }
}

/// The least memory limit [`memory_limit`] accepts. No process starts in less
/// (a runtime's own init needs several MiB; an RLIMIT_DATA this small fails the
/// dynamic loader), so a smaller limit is a suffix slip ("500m" is half a byte,
/// not 500 MiB) that would only crash-loop.
pub const MIN_MEMORY_LIMIT: u64 = 1 << 20;

/// A quantity's exact value: `digits × 10^exp`, the binary suffix already multiplied in.
struct Exact {
    /// Decimal digits, most significant first, no leading zeros (empty: zero).
    digits: Vec<u8>,
    exp: i128,
}

/// Parses as apimachinery's `ParseQuantity` does (sign, digits, optional
/// fraction, then a binary suffix Ki..Ei, a decimal one n u m k M G T P E, or a
/// decimal exponent e/E with a signed integer), exactly, in decimal digits. It
/// refuses what Pod validation refuses too: negative values, and a suffix with
/// no digits (apimachinery reads "Gi" as zero, nobody means that).
fn parse(text: &str) -> Result<Exact, QuantityError> {
    let t = text.trim();
    let (negative, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let int_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (int, rest) = t.split_at(int_end);
    let (frac, suffix) = match rest.strip_prefix('.') {
        Some(r) => r.split_at(r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len())),
        None => ("", rest),
    };
    if int.is_empty() && frac.is_empty() {
        return Err(err(text, "no number"));
    }
    let (dec, bin): (i128, u32) = match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        s => match s.strip_prefix(['e', 'E']).map(str::parse::<i64>) {
            Some(Ok(e)) => (i128::from(e), 0),
            _ => return Err(err(text, "unknown suffix")),
        },
    };
    let mut digits: Vec<u8> = int.bytes().chain(frac.bytes()).map(|b| b - b'0').collect();
    // Times 2^bin, ten bits at a time, least significant digit first.
    for _ in 0..bin / 10 {
        let mut carry = 0u32;
        for d in digits.iter_mut().rev() {
            let v = u32::from(*d) * 1024 + carry;
            *d = (v % 10) as u8;
            carry = v / 10;
        }
        while carry > 0 {
            digits.insert(0, (carry % 10) as u8);
            carry /= 10;
        }
    }
    let zeros = digits.iter().take_while(|d| **d == 0).count();
    digits.drain(..zeros);
    if negative && !digits.is_empty() {
        return Err(err(text, "must not be negative"));
    }
    Ok(Exact {
        digits,
        exp: dec - frac.len() as i128,
    })
}

/// `value × 10^scale`, rounded up (Kubernetes' `ScaledValue` rounds up);
/// `None` past 38 digits.
fn ceil_scaled(value: &Exact, scale: i128) -> Option<u128> {
    if value.digits.is_empty() {
        return Some(0);
    }
    // Digits left of the decimal point.
    let int_len = value.digits.len() as i128 + value.exp + scale;
    if int_len > 38 {
        return None;
    }
    let int_len = usize::try_from(int_len.max(0)).ok()?;
    let (int, frac) = value.digits.split_at(int_len.min(value.digits.len()));
    let mut n: u128 = int.iter().fold(0, |n, d| n * 10 + u128::from(*d));
    for _ in int.len()..int_len {
        n *= 10;
    }
    // Any non-zero digit past the point rounds up.
    Some(n + u128::from(frac.iter().any(|d| *d != 0)))
}

fn to_u64(text: &str, n: Option<u128>) -> Result<u64, QuantityError> {
    n.and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| err(text, "too large (more than 18446744073709551615)"))
}

/// CPU in millicores: "2" is 2000, "250m" is 250. Rounds up, as `MilliValue` does.
pub fn cpu_millis(text: &str) -> Result<u64, QuantityError> {
    to_u64(text, ceil_scaled(&parse(text)?, 3))
}

/// CPU in nanocores, as the metrics API reports usage: "123456n", "2m", "1".
pub fn cpu_nanos(text: &str) -> Result<u64, QuantityError> {
    to_u64(text, ceil_scaled(&parse(text)?, 9))
}

/// A byte count: "512Mi", "1G", "1048576". Rounds up, as `Value` does.
pub fn bytes(text: &str) -> Result<u64, QuantityError> {
    to_u64(text, ceil_scaled(&parse(text)?, 0))
}

/// A container's memory limit: `None` for zero (the runtime then sets none,
/// as the kubelet's does), else the bytes, refused below [`MIN_MEMORY_LIMIT`].
pub fn memory_limit(text: &str) -> Result<Option<u64>, QuantityError> {
    match bytes(text)? {
        0 => Ok(None),
        b if b < MIN_MEMORY_LIMIT => Err(err(
            text,
            "below 1Mi, too little memory for any process to start (\"m\" is milli: did you mean Mi?)",
        )),
        b => Ok(Some(b)),
    }
}

/// A whole count, for extended resources like nvidia.com/gpu: whole as the
/// apiserver validates it (`MilliValue() % 1000 == 0`, so "0.9999" is 1).
pub fn count(text: &str) -> Result<u64, QuantityError> {
    let millis = ceil_scaled(&parse(text)?, 3);
    if millis.is_some_and(|m| m % 1000 != 0) {
        return Err(err(text, "must be a whole number"));
    }
    to_u64(text, millis.map(|m| m / 1000))
}

/// CPU millicores written as a quantity: whole cores when exact ("64"), else "250m".
pub fn format_cpu(millis: u64) -> String {
    if millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        format!("{millis}m")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kubernetes_quantities() {
        assert_eq!(cpu_millis("2"), Ok(2000));
        assert_eq!(cpu_millis("250m"), Ok(250));
        assert_eq!(cpu_millis("0.5"), Ok(500));
        assert_eq!(bytes("512Mi"), Ok(512 << 20));
        assert_eq!(bytes("1G"), Ok(1_000_000_000));
        assert_eq!(bytes("100"), Ok(100));
        assert_eq!(count("8"), Ok(8));
        assert!(count("1.5").is_err());
        assert!(bytes("12Qi").is_err());
        assert!(cpu_millis("").is_err());
        assert!(cpu_millis("-1").is_err());
        assert!(bytes("1e400").is_err());
        assert_eq!(format_cpu(64_000), "64");
        assert_eq!(format_cpu(250), "250m");
    }

    #[test]
    fn every_form_the_apiserver_admits() {
        assert_eq!(bytes("1E"), Ok(1_000_000_000_000_000_000));
        assert_eq!(bytes("2Ei"), Ok(2 << 60));
        assert_eq!(bytes("1Ti"), Ok(1 << 40));
        assert_eq!(bytes("3Pi"), Ok(3 << 50));
        assert_eq!(cpu_millis("500000u"), Ok(500));
        assert_eq!(cpu_millis("100000000n"), Ok(100));
        assert_eq!(cpu_millis("1e3"), Ok(1_000_000));
        assert_eq!(cpu_millis("1E-3"), Ok(1));
        assert_eq!(cpu_millis("1.5e3"), Ok(1_500_000));
        assert_eq!(bytes("5e+2"), Ok(500));
        assert_eq!(bytes("+1Ki"), Ok(1024));
        assert_eq!(cpu_millis(".5"), Ok(500));
        assert_eq!(cpu_millis("1."), Ok(1000));
        assert_eq!(count("1e1"), Ok(10));
        assert_eq!(count("-0"), Ok(0));
        // What the apiserver itself refuses.
        for bad in [
            "1K", "1ki", "1e", "1Ee3", "1e3.5", "1.2.3", "0x10", "1 Gi", "1Mi5",
        ] {
            assert!(bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn exact_and_rounded_up_like_kubernetes() {
        // 2^53 + 1 is not a float; a float parser loses the last byte.
        assert_eq!(bytes("9007199254740993"), Ok(9_007_199_254_740_993));
        assert_eq!(bytes("18446744073709551615"), Ok(u64::MAX));
        // Value() and MilliValue() round up.
        assert_eq!(bytes("1n"), Ok(1));
        assert_eq!(bytes("0.1Ki"), Ok(103));
        assert_eq!(bytes("1.0000000000000000000000001"), Ok(2));
        assert_eq!(cpu_millis("1n"), Ok(1));
        assert_eq!(cpu_millis("0.0001"), Ok(1));
        assert_eq!(cpu_millis("1e-400"), Ok(1));
        assert_eq!(cpu_millis("0e400"), Ok(0));
        // An integer resource is whole once rounded up to millis, as the
        // apiserver validates it (and the device manager reads Value()).
        assert_eq!(count("0.9999"), Ok(1));
        assert!(count("1.0001").is_err());
    }

    #[test]
    fn a_memory_limit_no_process_runs_in_is_refused_by_name() {
        // 500m is half a byte, rounded up to one: a crash loop, never a container.
        let e = memory_limit("500m").unwrap_err().to_string();
        assert!(e.contains("\"500m\"") && e.contains("1Mi"), "{e}");
        assert!(memory_limit("128").is_err());
        assert!(memory_limit("1048575").is_err());
        assert_eq!(memory_limit("1Mi"), Ok(Some(MIN_MEMORY_LIMIT)));
        assert_eq!(memory_limit("500Mi"), Ok(Some(500 << 20)));
        // Zero sets no limit, as the kubelet's runtimes read it.
        assert_eq!(memory_limit("0"), Ok(None));
        // Requests and sizes keep Kubernetes' rounding.
        assert_eq!(bytes("500m"), Ok(1));
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        for (f, text) in [
            (cpu_millis as fn(&str) -> Result<u64, QuantityError>, "1E"),
            (cpu_millis, "18446744073709552"),
            (bytes, "18446744073709551616"),
            (bytes, "16Ei"),
            (bytes, "9e18Ei"),
            (bytes, "1e99999999"),
            (bytes, "1e99999999999999999999"),
            (count, "20E"),
        ] {
            let e = f(text).unwrap_err();
            assert_eq!(e.text, text);
        }
    }
}
