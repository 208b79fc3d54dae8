//! Logs, exec, attach and port-forward: the requests and the byte streams.

use std::fmt;
use std::time::SystemTime;

use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

/// Which log a read wants and whether it continues.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogRequest {
    /// The previous run of the container (after a restart).
    pub previous: bool,
    /// Keep streaming new lines until the container stops.
    pub follow: bool,
    /// Only the last this many lines of what was written (`tailLines`).
    pub tail_lines: Option<u64>,
    /// Only lines written at or after this time (`sinceSeconds`, `sinceTime`).
    pub since: Option<SystemTime>,
    /// Only about this many bytes of content, from the start of what the
    /// other bounds leave (`limitBytes`).
    pub limit_bytes: Option<u64>,
}

/// One line of a container's log, with the time it was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    pub time: SystemTime,
    /// The line's bytes, including its trailing newline.
    pub bytes: bytes::Bytes,
}

/// What a log read returns: the lines written so far, and with `follow` the lines
/// still to come (ending when the container stops). A backend reads only what
/// the request's bounds leave where it can (a tenant's log may be gigabytes);
/// vkd applies sinceSeconds, sinceTime, tailLines, limitBytes and timestamps
/// on top, exactly, so a backend may return more than asked, never less.
pub struct Logs {
    pub history: Vec<LogLine>,
    pub follow: Option<BoxStream<'static, LogLine>>,
}

impl fmt::Debug for Logs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Logs")
            .field("history", &self.history.len())
            .field("follow", &self.follow.is_some())
            .finish()
    }
}

/// A terminal size sent by a client (`kubectl exec -t` on resize).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TermSize {
    #[serde(rename = "Width")]
    pub width: u16,
    #[serde(rename = "Height")]
    pub height: u16,
}

pub type BoxRead = Box<dyn tokio::io::AsyncRead + Send + Unpin>;
pub type BoxWrite = Box<dyn tokio::io::AsyncWrite + Send + Unpin>;

/// The streams of an exec or attach session. Absent streams were not requested.
pub struct StreamIo {
    pub stdin: Option<BoxRead>,
    pub stdout: Option<BoxWrite>,
    /// `None` with a tty: stderr goes to stdout.
    pub stderr: Option<BoxWrite>,
    pub tty: bool,
    pub resize: Option<tokio::sync::mpsc::Receiver<TermSize>>,
}

impl fmt::Debug for StreamIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamIo")
            .field("stdin", &self.stdin.is_some())
            .field("stdout", &self.stdout.is_some())
            .field("stderr", &self.stderr.is_some())
            .field("tty", &self.tty)
            .finish()
    }
}

/// A byte stream both ways, for port-forward.
pub trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Duplex for T {}
