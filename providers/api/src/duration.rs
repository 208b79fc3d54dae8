//! Annotation-style durations: "250us", "500ms", "3s", "2m", "1h" or plain seconds.

use std::time::Duration;

/// The longest duration [`parse`] accepts: 365 days. Anything longer is a
/// mistake, and added to a clock it could overflow the clock (a panic).
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{text:?} is not a duration like 500ms, 2s, 5m or 1h")]
    Format { text: String },
    #[error("{text:?} is longer than the maximum of 365 days (8760h)")]
    TooLong { text: String },
}

/// Reads a duration exactly (no float rounding); fractions below a nanosecond
/// are dropped. At most [`MAX_DURATION`].
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let format = || DurationError::Format {
        text: text.to_owned(),
    };
    let too_long = || DurationError::TooLong {
        text: text.to_owned(),
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(format());
    }
    let unit_nanos: u128 = match unit {
        "us" => 1_000,
        "ms" => 1_000_000,
        "" | "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return Err(format()),
    };
    let max = MAX_DURATION.as_nanos();
    let int = int.trim_start_matches('0');
    // More digits than u128 holds is far past the maximum anyway.
    let whole: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_long())?
    };
    // 18 fraction digits are below a nanosecond even in hours.
    let frac18: u128 = format!("{frac:0<18}")[..18].parse().map_err(|_| format())?;
    let nanos = whole
        .checked_mul(unit_nanos)
        .and_then(|n| n.checked_add(frac18 * unit_nanos / 1_000_000_000_000_000_000))
        .filter(|n| *n <= max)
        .ok_or_else(too_long)?;
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| too_long())?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_is_wrong() {
        assert_eq!(
            parse("18000000000000000000"),
            Err(DurationError::TooLong {
                text: "18000000000000000000".into()
            })
        );
        assert_eq!(
            parse("1d"),
            Err(DurationError::Format { text: "1d".into() })
        );
        assert!(
            parse(&"9".repeat(100))
                .unwrap_err()
                .to_string()
                .contains("365 days")
        );
        assert_eq!(parse("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse(".25s"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("0.0000000001s"), Ok(Duration::ZERO));
    }
}
