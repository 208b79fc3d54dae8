//! A log's history as a plugin sends it, held within bounds: a plugin may
//! ignore the request's bounds (or have a log of gigabytes), and vkd must not
//! hold more than the request can show.

use std::collections::VecDeque;
use std::time::SystemTime;

use vkd_provider::{LogLine, LogRequest};

/// The most of a history held for one request: what a `kubectl logs`
/// without `--tail` or `--limit-bytes` may show through a plugin.
pub(super) const HISTORY_MAX: u64 = 64 << 20;

/// The history so far, with the request's `sinceTime`, `tailLines` and
/// `limitBytes` applied as lines arrive.
#[derive(Debug)]
pub(super) struct History {
    since: Option<SystemTime>,
    tail: Option<u64>,
    limit: Option<u64>,
    lines: VecDeque<LogLine>,
    bytes: u64,
}

impl History {
    pub(super) fn new(request: &LogRequest) -> Self {
        Self {
            since: request.since,
            tail: request.tail_lines,
            limit: request.limit_bytes,
            lines: VecDeque::new(),
            bytes: 0,
        }
    }

    /// Takes the next line; an error when what must be held is past
    /// [`HISTORY_MAX`].
    pub(super) fn push(&mut self, line: LogLine) -> Result<(), String> {
        if self.since.is_some_and(|s| line.time < s) {
            return Ok(());
        }
        // Without a tail, limitBytes counts from the first line: once it is
        // reached, later lines are never shown.
        if self.tail.is_none() && self.limit.is_some_and(|l| self.bytes >= l) {
            return Ok(());
        }
        self.bytes = self.bytes.saturating_add(line.bytes.len() as u64);
        self.lines.push_back(line);
        if let Some(tail) = self.tail {
            while self.lines.len() as u64 > tail {
                if let Some(old) = self.lines.pop_front() {
                    self.bytes = self.bytes.saturating_sub(old.bytes.len() as u64);
                }
            }
        }
        if self.bytes > HISTORY_MAX {
            return Err(format!(
                "the log's history is larger than {} MiB; ask for less of it (--tail, --limit-bytes, --since)",
                HISTORY_MAX >> 20
            ));
        }
        Ok(())
    }

    pub(super) fn into_lines(self) -> Vec<LogLine> {
        self.lines.into()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn line(at: u64, text: &str) -> LogLine {
        LogLine {
            time: SystemTime::UNIX_EPOCH + Duration::from_secs(at),
            bytes: bytes::Bytes::copy_from_slice(text.as_bytes()),
        }
    }

    fn held(request: LogRequest, lines: &[(u64, &str)]) -> Vec<String> {
        let mut h = History::new(&request);
        for (at, text) in lines {
            h.push(line(*at, text)).expect("within bounds");
        }
        h.into_lines()
            .into_iter()
            .map(|l| String::from_utf8_lossy(&l.bytes).into_owned())
            .collect()
    }

    #[test]
    fn the_requests_bounds_are_applied_as_lines_arrive() {
        let lines = [(1, "a\n"), (2, "bb\n"), (3, "ccc\n"), (4, "dddd\n")];
        assert_eq!(held(LogRequest::default(), &lines).len(), 4);
        let tail = LogRequest {
            tail_lines: Some(2),
            ..LogRequest::default()
        };
        assert_eq!(held(tail, &lines), ["ccc\n", "dddd\n"]);
        let since = LogRequest {
            since: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(3)),
            ..LogRequest::default()
        };
        assert_eq!(held(since, &lines), ["ccc\n", "dddd\n"]);
        // limitBytes from the start: the line that reaches it is kept whole
        // (vkd cuts it later), none after it.
        let limit = LogRequest {
            limit_bytes: Some(4),
            ..LogRequest::default()
        };
        assert_eq!(held(limit, &lines), ["a\n", "bb\n"]);
        let none = LogRequest {
            tail_lines: Some(0),
            ..LogRequest::default()
        };
        assert!(held(none, &lines).is_empty());
    }

    #[test]
    fn a_history_past_the_bound_is_refused_unless_the_request_keeps_it_small() {
        let mib = "x".repeat(1 << 20);
        let mut all = History::new(&LogRequest::default());
        let refused = (0..HISTORY_MAX + 8).find_map(|i| all.push(line(i, &mib)).err());
        let why = refused.expect("refused past the bound");
        assert!(
            why.contains("larger than 64 MiB") && why.contains("--tail"),
            "{why}"
        );
        for bounded in [
            LogRequest {
                tail_lines: Some(3),
                ..LogRequest::default()
            },
            LogRequest {
                limit_bytes: Some(10 << 20),
                ..LogRequest::default()
            },
        ] {
            let mut h = History::new(&bounded);
            for i in 0..200 {
                h.push(line(i, &mib)).expect("bounded by the request");
            }
            assert!(h.bytes <= 10 << 20, "{} bytes held", h.bytes);
        }
    }
}
