//! `/containerLogs`: the query (kubelet semantics, 422 on invalid values) and
//! the shaping of a provider's lines into the response body.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt};
use vkd_provider::{LogLine, LogRequest, Logs};

/// PodLogOptions as the kubelet reads them from the query string.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogQuery {
    pub follow: bool,
    pub previous: bool,
    pub timestamps: bool,
    pub since_seconds: Option<i64>,
    pub since_time: Option<SystemTime>,
    pub tail_lines: Option<i64>,
    pub limit_bytes: Option<i64>,
}

/// Go's strconv.ParseBool, which the kubelet's query decoding uses.
fn parse_bool(name: &str, v: &str) -> Result<bool, String> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" | "" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("{name}: invalid value {v:?}: must be a boolean")),
    }
}

fn parse_int(name: &str, v: &str) -> Result<i64, String> {
    v.parse::<i64>()
        .map_err(|_| format!("{name}: invalid value {v:?}: must be an integer"))
}

/// Splits a query string into decoded pairs (`+` a space, `%xx` a byte, a
/// bad escape kept as written, as Go's `url.ParseQuery` does for the kubelet).
pub fn query_pairs(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect()
}

/// An RFC 3339 time. jiff's Timestamp ends on 9999-12-30 (so that any civil
/// time with any offset fits in it) but RFC 3339, Go and so the kubelet go on
/// to 9999-12-31T23:59:59Z and beyond with a negative offset: those are read
/// from their civil parts.
fn parse_time(v: &str) -> Option<SystemTime> {
    if let Ok(t) = v.parse::<jiff::Timestamp>() {
        return Some(SystemTime::from(t));
    }
    let pieces = jiff::fmt::temporal::Pieces::parse(v).ok()?;
    let civil = pieces.date().to_datetime(pieces.time()?);
    let offset = pieces.offset()?.to_numeric_offset();
    let since_epoch = civil
        .duration_since(jiff::civil::DateTime::constant(1970, 1, 1, 0, 0, 0, 0))
        .checked_sub(jiff::SignedDuration::from_secs(i64::from(offset.seconds())))?;
    let magnitude = since_epoch.unsigned_abs();
    if since_epoch.is_negative() {
        SystemTime::UNIX_EPOCH.checked_sub(magnitude)
    } else {
        SystemTime::UNIX_EPOCH.checked_add(magnitude)
    }
}

/// Parses and validates the query; an error is the 422 message.
pub fn parse_query(query: &str) -> Result<LogQuery, String> {
    let mut q = LogQuery::default();
    let mut legacy_tail = None;
    for (k, v) in query_pairs(query) {
        match k.as_str() {
            "follow" => q.follow = parse_bool(&k, &v)?,
            "previous" => q.previous = parse_bool(&k, &v)?,
            "timestamps" => q.timestamps = parse_bool(&k, &v)?,
            "sinceSeconds" => q.since_seconds = Some(parse_int(&k, &v)?),
            "sinceTime" => {
                q.since_time =
                    Some(parse_time(&v).ok_or_else(|| {
                        format!("sinceTime: invalid value {v:?}: must be RFC 3339")
                    })?);
            }
            "tailLines" => q.tail_lines = Some(parse_int(&k, &v)?),
            "limitBytes" => q.limit_bytes = Some(parse_int(&k, &v)?),
            "tail" => {
                legacy_tail = if v == "all" {
                    Some(None)
                } else {
                    Some(Some(parse_int(&k, &v)?))
                };
            }
            _ => {}
        }
    }
    if q.tail_lines.is_none()
        && let Some(t) = legacy_tail
    {
        q.tail_lines = t;
    }
    if q.since_seconds.is_some() && q.since_time.is_some() {
        return Err("at most one of sinceTime or sinceSeconds may be specified".into());
    }
    if q.since_seconds.is_some_and(|s| s < 1) {
        return Err("sinceSeconds: Invalid value: must be greater than 0".into());
    }
    if q.tail_lines.is_some_and(|t| t < 0) {
        return Err("tailLines: Invalid value: must be greater than or equal to 0".into());
    }
    if q.limit_bytes.is_some_and(|b| b < 1) {
        return Err("limitBytes: Invalid value: must be greater than 0".into());
    }
    Ok(q)
}

impl LogQuery {
    /// The earliest line it shows: the later of sinceSeconds and sinceTime.
    fn since(&self, now: SystemTime) -> Option<SystemTime> {
        [
            // Past the start of time (checked: the number is the client's): no bound.
            self.since_seconds
                .and_then(|s| now.checked_sub(Duration::from_secs(s.unsigned_abs()))),
            self.since_time,
        ]
        .into_iter()
        .flatten()
        .max()
    }

    /// The bounds the provider reads within (it need not read the whole log).
    pub fn request(&self, now: SystemTime) -> LogRequest {
        LogRequest {
            previous: self.previous,
            follow: self.follow,
            tail_lines: self.tail_lines.and_then(|n| u64::try_from(n).ok()),
            since: self.since(now),
            limit_bytes: self.limit_bytes.and_then(|n| u64::try_from(n).ok()),
        }
    }
}

/// RFC3339NanoFixed, as the kubelet prefixes lines with `timestamps=true`.
fn timestamp(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t)
        .map(|ts| ts.strftime("%Y-%m-%dT%H:%M:%S.%9fZ").to_string())
        .unwrap_or_default()
}

/// Applies since, tail, timestamps and limitBytes to the provider's lines.
pub fn shape(logs: Logs, q: &LogQuery, now: SystemTime) -> BoxStream<'static, Bytes> {
    let since = q.since(now);
    let keep = move |l: &LogLine| since.is_none_or(|s| l.time >= s);
    let mut history: Vec<LogLine> = logs.history.into_iter().filter(keep).collect();
    if let Some(n) = q.tail_lines {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        let skip = history.len().saturating_sub(n);
        history.drain(..skip);
    }
    let stamps = q.timestamps;
    let render = move |l: LogLine| -> Bytes {
        if stamps {
            let mut b = timestamp(l.time).into_bytes();
            b.push(b' ');
            b.extend_from_slice(&l.bytes);
            Bytes::from(b)
        } else {
            l.bytes
        }
    };
    let head = stream::iter(history).map(render);
    let body: BoxStream<'static, Bytes> = match logs.follow {
        Some(rest) if q.follow => head
            .chain(
                rest.filter(move |l| std::future::ready(keep(l)))
                    .map(render),
            )
            .boxed(),
        _ => head.boxed(),
    };
    match q.limit_bytes {
        None => body,
        Some(limit) => {
            let mut left = u64::try_from(limit).unwrap_or(0);
            body.take_while(move |_| std::future::ready(left > 0))
                .map(move |b| {
                    let n = (b.len() as u64).min(left);
                    left -= n;
                    b.slice(..usize::try_from(n).unwrap_or(0))
                })
                .boxed()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The provider is told the bounds, so it reads only what is shown.
    #[test]
    fn the_provider_is_asked_for_only_what_is_shown() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let q = parse_query("tailLines=10&sinceSeconds=60&limitBytes=4096&follow=true").unwrap();
        assert_eq!(
            q.request(now),
            LogRequest {
                previous: false,
                follow: true,
                tail_lines: Some(10),
                since: Some(now - Duration::from_secs(60)),
                limit_bytes: Some(4096),
            }
        );
        let later = parse_query("sinceSeconds=60&sinceTime=1970-01-12T13:46:50Z");
        assert!(later.is_err(), "one of the two, as the kubelet");
        let plain = parse_query("").unwrap().request(now);
        assert_eq!(plain, LogRequest::default());
    }

    fn lines(n: u64, t0: SystemTime) -> Logs {
        Logs {
            history: (0..n)
                .map(|i| LogLine {
                    time: t0 + Duration::from_secs(i),
                    bytes: Bytes::from(format!("line {i}\n")),
                })
                .collect(),
            follow: None,
        }
    }

    async fn collect(s: BoxStream<'static, Bytes>) -> String {
        let parts: Vec<Bytes> = s.collect().await;
        parts
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect()
    }

    #[test]
    fn query_pairs_decode_as_gos_parse_query() {
        let pairs = query_pairs("a=%zz&b=x+y&c=%41%2f&&d&e=%e2%82%ac");
        let want = [
            ("a", "%zz"),
            ("b", "x y"),
            ("c", "A/"),
            ("d", ""),
            ("e", "\u{20ac}"),
        ];
        let got: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (&**k, &**v)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn query_validation_matches_the_kubelet() {
        assert_eq!(
            parse_query("follow=true&tailLines=3").unwrap().tail_lines,
            Some(3)
        );
        assert_eq!(parse_query("tail=5").unwrap().tail_lines, Some(5));
        assert_eq!(parse_query("tail=all").unwrap().tail_lines, None);
        assert!(parse_query("sinceSeconds=0").is_err());
        assert!(parse_query("tailLines=-1").is_err());
        assert!(parse_query("limitBytes=0").is_err());
        assert!(parse_query("follow=maybe").is_err());
        assert!(parse_query("sinceSeconds=10&sinceTime=2026-01-01T00:00:00Z").is_err());
        let q = parse_query("sinceTime=2026-01-01T00%3A00%3A00Z&timestamps=1").unwrap();
        assert!(q.timestamps && q.since_time.is_some());
        assert!(parse_query("sinceTime=yesterday").is_err());
        assert_eq!(parse_query("unknown=1&%zz=%").unwrap(), LogQuery::default());
    }

    #[tokio::test]
    async fn far_future_since_time_is_valid_and_empties_the_log() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        // 9999-12-31T23:59:59Z, as Go's time.Unix would give it.
        let last = SystemTime::UNIX_EPOCH + Duration::from_secs(253_402_300_799);
        for (v, want) in [
            ("9999-12-31T23:59:59Z", last),
            ("9999-12-31T23:59:59.5Z", last + Duration::from_millis(500)),
            (
                "9999-12-31T23:59:59%2B01:00",
                last - Duration::from_secs(3600),
            ),
            // Year 9999 locally, 10000 in UTC: still RFC 3339.
            (
                "9999-12-31T23:59:59-01:00",
                last + Duration::from_secs(3600),
            ),
            ("9999-12-30T23:00:00Z", last - Duration::from_secs(89_999)),
        ] {
            let q = parse_query(&format!("sinceTime={v}"))
                .unwrap_or_else(|e| panic!("sinceTime={v}: {e}"));
            assert_eq!(q.since_time, Some(want), "sinceTime={v}");
            assert_eq!(collect(shape(lines(3, t0), &q, t0)).await, "", "{v}");
        }
        assert!(parse_query("sinceTime=9999-12-31T23:59:59").is_err());
        assert!(parse_query("sinceTime=9999-12-32T00:00:00Z").is_err());
    }

    #[tokio::test]
    async fn huge_since_seconds_keeps_everything_without_panicking() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let q = parse_query(&format!("sinceSeconds={}", i64::MAX)).unwrap();
        assert_eq!(
            collect(shape(lines(2, t0), &q, t0)).await,
            "line 0\nline 1\n"
        );
    }

    #[tokio::test]
    async fn tail_since_limit_and_timestamps() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let now = t0 + Duration::from_secs(10);
        let q = LogQuery {
            tail_lines: Some(2),
            ..Default::default()
        };
        assert_eq!(
            collect(shape(lines(10, t0), &q, now)).await,
            "line 8\nline 9\n"
        );
        let q = LogQuery {
            since_seconds: Some(3),
            ..Default::default()
        };
        assert_eq!(
            collect(shape(lines(10, t0), &q, now)).await,
            "line 7\nline 8\nline 9\n"
        );
        let q = LogQuery {
            limit_bytes: Some(9),
            ..Default::default()
        };
        assert_eq!(collect(shape(lines(10, t0), &q, now)).await, "line 0\nli");
        let q = LogQuery {
            timestamps: true,
            tail_lines: Some(1),
            ..Default::default()
        };
        assert_eq!(
            collect(shape(lines(10, t0), &q, now)).await,
            "2027-01-15T08:00:09.000000000Z line 9\n"
        );
    }
}
