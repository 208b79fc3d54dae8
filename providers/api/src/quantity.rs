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

/// Splits "1.5Gi" into (1.5, multiplier of "Gi").
fn split(text: &str) -> Result<(f64, f64), QuantityError> {
    let t = text.trim();
    let at = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(at);
    if num.is_empty() {
        return Err(err(text, "no number"));
    }
    let value: f64 = num.parse().map_err(|_| err(text, "not a number"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(err(text, "must be a non-negative number"));
    }
    let mult = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0f64.powi(4),
        "Pi" => 1024.0f64.powi(5),
        _ => return Err(err(text, "unknown suffix")),
    };
    Ok((value, mult))
}

/// CPU in millicores: "2" is 2000, "250m" is 250. Rounds up, as the scheduler does.
pub fn cpu_millis(text: &str) -> Result<u64, QuantityError> {
    let (v, m) = split(text)?;
    let millis = (v * m * 1000.0).ceil();
    if millis > u64::MAX as f64 {
        return Err(err(text, "too large"));
    }
    Ok(millis as u64)
}

/// A byte count: "512Mi", "1G", "1048576". Rounds up.
pub fn bytes(text: &str) -> Result<u64, QuantityError> {
    let (v, m) = split(text)?;
    let b = (v * m).ceil();
    if b > u64::MAX as f64 {
        return Err(err(text, "too large"));
    }
    Ok(b as u64)
}

/// A whole count, for extended resources like nvidia.com/gpu.
pub fn count(text: &str) -> Result<u64, QuantityError> {
    let (v, m) = split(text)?;
    let n = v * m;
    if n.fract() != 0.0 {
        return Err(err(text, "must be a whole number"));
    }
    if n > u64::MAX as f64 {
        return Err(err(text, "too large"));
    }
    Ok(n as u64)
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
}
