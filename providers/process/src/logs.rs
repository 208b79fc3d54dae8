//! Container log files, in the CRI format the kubelet reads:
//! `<RFC 3339 nano time> <stdout|stderr> <F|P> <content>`, one line per line
//! written (P marks a piece of a line longer than [`MAX_LINE`]).
//!
//! `current.log` grows to the size bound, then becomes `current.log.1` (the one
//! before it is dropped). When the container restarts, `current.log` becomes
//! `previous.log`, which `kubectl logs --previous` reads.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use vkd_provider::{ContainerState, LogLine, LogRequest, Logs, ProviderError, Result};

use crate::io_err;

pub const MAX_LINE: usize = 16 * 1024;

#[derive(Debug)]
pub struct LogWriter {
    dir: PathBuf,
    file: std::fs::File,
    written: u64,
    max_bytes: u64,
}

pub fn current(dir: &Path) -> PathBuf {
    dir.join("current.log")
}
pub fn rotated(dir: &Path) -> PathBuf {
    dir.join("current.log.1")
}
pub fn previous(dir: &Path) -> PathBuf {
    dir.join("previous.log")
}

impl LogWriter {
    /// Opens the log of a new run: the last run's log becomes `previous.log`.
    pub fn start_run(dir: &Path, max_bytes: u64, restarted: bool) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        if restarted && current(dir).exists() {
            std::fs::rename(current(dir), previous(dir))?;
            let _ = std::fs::remove_file(rotated(dir));
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(current(dir))?;
        let written = file.metadata()?.len();
        Ok(Self {
            dir: dir.to_owned(),
            file,
            written,
            max_bytes: max_bytes.max(4096),
        })
    }

    /// Appends one line (without its newline) from `stream`.
    pub fn line(&mut self, stream: &str, content: &[u8], complete: bool) -> std::io::Result<()> {
        let mut chunks = content.chunks(MAX_LINE).peekable();
        if chunks.peek().is_none() {
            return self.record(stream, b"", complete);
        }
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            self.record(stream, chunk, complete && last)?;
        }
        Ok(())
    }

    fn record(&mut self, stream: &str, content: &[u8], complete: bool) -> std::io::Result<()> {
        let time = jiff::Timestamp::try_from(SystemTime::now())
            .map(|t| format!("{t:.9}"))
            .unwrap_or_default();
        let mut buf = Vec::with_capacity(content.len() + 48);
        write!(buf, "{time} {stream} {} ", if complete { 'F' } else { 'P' })?;
        buf.extend_from_slice(content);
        buf.push(b'\n');
        if self.written + buf.len() as u64 > self.max_bytes && self.written > 0 {
            std::fs::rename(current(&self.dir), rotated(&self.dir))?;
            self.file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(current(&self.dir))?;
            self.written = 0;
        }
        self.file.write_all(&buf)?;
        self.written += buf.len() as u64;
        Ok(())
    }
}

/// Parses one CRI log line back into a [`LogLine`]; `None` for a malformed line.
pub fn parse_line(line: &[u8]) -> Option<LogLine> {
    let text_end = line.iter().position(|b| *b == b' ')?;
    let time: jiff::Timestamp = std::str::from_utf8(&line[..text_end]).ok()?.parse().ok()?;
    let rest = &line[text_end + 1..];
    let stream_end = rest.iter().position(|b| *b == b' ')?;
    let rest = &rest[stream_end + 1..];
    let (tag, content) = (rest.first()?, rest.get(2..).unwrap_or_default());
    let content = content.strip_suffix(b"\n").unwrap_or(content);
    let mut bytes = content.to_vec();
    if *tag == b'F' {
        bytes.push(b'\n');
    }
    Some(LogLine {
        time: SystemTime::from(time),
        bytes: bytes.into(),
    })
}

/// Every line of a file, and the offset after the last complete line.
pub fn read_file(path: &Path, from: u64) -> std::io::Result<(Vec<LogLine>, u64)> {
    use std::io::Seek;
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    f.seek(std::io::SeekFrom::Start(from))?;
    let mut reader = std::io::BufReader::new(f);
    let mut out = Vec::new();
    let mut offset = from;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader.read_until(b'\n', &mut buf)?;
        if n == 0 || buf.last() != Some(&b'\n') {
            break;
        }
        offset += n as u64;
        if let Some(l) = parse_line(&buf) {
            out.push(l);
        }
    }
    Ok((out, offset))
}

/// What of a log file a read keeps: lines from `since` on, until `limit`
/// bytes of content are held.
#[derive(Clone, Copy, Debug, Default)]
struct Bounds {
    since: Option<SystemTime>,
    limit: Option<u64>,
}

impl Bounds {
    fn of(request: &LogRequest) -> Self {
        Self {
            since: request.since,
            limit: request.limit_bytes,
        }
    }

    fn full(&self, held: &[LogLine]) -> bool {
        self.limit
            .is_some_and(|l| held.iter().map(|x| x.bytes.len() as u64).sum::<u64>() >= l)
    }
}

/// [`read_file`] within `bounds`: older lines are skipped, and reading stops
/// once the limit is met (the offset is then where it stopped).
fn read_bounded(path: &Path, bounds: Bounds, held: &mut Vec<LogLine>) -> std::io::Result<u64> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => std::io::BufReader::new(f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut content: u64 = held.iter().map(|l| l.bytes.len() as u64).sum();
    let (mut offset, mut buf) = (0u64, Vec::new());
    loop {
        if bounds.limit.is_some_and(|l| content >= l) {
            return Ok(offset);
        }
        buf.clear();
        let n = f.read_until(b'\n', &mut buf)?;
        if n == 0 || buf.last() != Some(&b'\n') {
            return Ok(offset);
        }
        offset += n as u64;
        if let Some(l) = parse_line(&buf)
            && bounds.since.is_none_or(|s| l.time >= s)
        {
            content += l.bytes.len() as u64;
            held.push(l);
        }
    }
}

/// The lines of `files` (oldest first) that `request` asks for, reading no
/// more of them than it needs: with a tail, only their ends; with a limit,
/// only up to it. Returns the offset after the last line read of the last file.
fn read_within(files: &[PathBuf], request: &LogRequest) -> std::io::Result<(Vec<LogLine>, u64)> {
    let bounds = Bounds::of(request);
    let mut offset = 0;
    let Some(n) = request.tail_lines else {
        let mut held = Vec::new();
        for (i, f) in files.iter().enumerate() {
            if bounds.full(&held) {
                break;
            }
            let end = read_bounded(f, bounds, &mut held)?;
            if i + 1 == files.len() {
                offset = end;
            }
        }
        return Ok((held, offset));
    };
    // The kubelet's order: the tail first, then since and the limit on it.
    let n = usize::try_from(n).unwrap_or(usize::MAX);
    let mut held: Vec<LogLine> = Vec::new();
    for (i, f) in files.iter().enumerate().rev() {
        let left = n - held.len();
        if left == 0 {
            break;
        }
        let (mut older, end) = last_lines(f, left)?;
        if i + 1 == files.len() {
            offset = end;
        }
        older.append(&mut held);
        held = older;
    }
    held.retain(|l| bounds.since.is_none_or(|s| l.time >= s));
    Ok((held, offset))
}

/// The last `n` complete lines of a file, reading back from its end in
/// blocks (a log of gigabytes costs what its tail does), and the offset
/// after the last complete line.
fn last_lines(path: &Path, n: usize) -> std::io::Result<(Vec<LogLine>, u64)> {
    use std::io::{Read, Seek, SeekFrom};
    const BLOCK: u64 = 64 * 1024;
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let mut start = f.metadata()?.len();
    let mut tail = Vec::<u8>::new();
    let complete = loop {
        let from = start.saturating_sub(BLOCK);
        let mut block = vec![0; usize::try_from(start - from).unwrap_or(0)];
        f.seek(SeekFrom::Start(from))?;
        f.read_exact(&mut block)?;
        block.extend_from_slice(&tail);
        tail = block;
        start = from;
        let complete = tail.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        let newlines = tail[..complete].iter().filter(|b| **b == b'\n').count();
        // Past n newlines, the n lines after the first are whole.
        if start == 0 || newlines > n {
            break complete;
        }
    };
    let lines: Vec<&[u8]> = tail[..complete].split_inclusive(|b| *b == b'\n').collect();
    // From a start mid-file, the first piece may be part of a line.
    let whole = &lines[usize::from(start > 0).min(lines.len())..];
    let keep = &whole[whole.len().saturating_sub(n)..];
    let out = keep.iter().filter_map(|l| parse_line(l)).collect();
    Ok((out, start + complete as u64))
}

/// The content of the last `lines` lines of the log in `dir`, at most its last
/// `max_bytes` bytes: what the kubelet makes a failed container's termination
/// message of. Reads only the end of the files, however large they are.
pub fn tail(dir: &Path, lines: usize, max_bytes: usize) -> Vec<u8> {
    use std::io::{Read, Seek};
    // A log line's prefix (time, stream, tag) is under 64 bytes.
    let window = lines.saturating_mul(MAX_LINE + 64).min(4 << 20) as u64;
    let mut out: Vec<LogLine> = Vec::new();
    for path in [current(dir), rotated(dir)] {
        let Ok(mut f) = std::fs::File::open(&path) else {
            continue;
        };
        let len = f.metadata().map_or(0, |m| m.len());
        let from = len.saturating_sub(window);
        let mut buf = Vec::new();
        if f.seek(std::io::SeekFrom::Start(from)).is_err()
            || f.take(window).read_to_end(&mut buf).is_err()
        {
            continue;
        }
        // A window that starts mid-line drops that first piece.
        let body = if from > 0 {
            buf.iter()
                .position(|b| *b == b'\n')
                .map_or(&buf[..0], |i| &buf[i + 1..])
        } else {
            &buf[..]
        };
        let mut found: Vec<LogLine> = body
            .split_inclusive(|b| *b == b'\n')
            .filter(|l| l.ends_with(b"\n"))
            .filter_map(parse_line)
            .collect();
        found.append(&mut out);
        out = found;
        if out.len() >= lines || from > 0 {
            break;
        }
    }
    let skip = out.len().saturating_sub(lines);
    let text: Vec<u8> = out[skip..].iter().flat_map(|l| l.bytes.to_vec()).collect();
    text[text.len().saturating_sub(max_bytes)..].to_vec()
}

impl crate::ProcessProvider {
    /// `kubectl logs`: the container's log as written, and with `follow`
    /// what it writes next, until it stops.
    pub(crate) fn read_logs(
        &self,
        uid: &str,
        container: &str,
        request: LogRequest,
    ) -> Result<Logs> {
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, _, st) = self.read(uid)?.ok_or_else(not_found)?;
        let known = st.as_ref().is_some_and(|s| {
            s.containers
                .iter()
                .chain(&s.init)
                .chain(s.ephemeral.iter().flatten())
                .any(|c| c.status.name == container)
        });
        if !known {
            return Err(ProviderError::invalid(
                "NotFound",
                format!("no container {container:?} in this Pod"),
            ));
        }
        let dir = sb.logs(container);
        if request.previous {
            if !previous(&dir).exists() {
                return Err(ProviderError::invalid(
                    "NotFound",
                    format!("previous terminated container {container:?} not found"),
                ));
            }
            let (history, _) = read_within(&[previous(&dir)], &request).map_err(io_err(&dir))?;
            return Ok(Logs {
                history,
                follow: None,
            });
        }
        let (history, offset) =
            read_within(&[rotated(&dir), current(&dir)], &request).map_err(io_err(&dir))?;
        // A limit already met needs nothing more.
        let follow = (request.follow && !Bounds::of(&request).full(&history)).then(|| {
            let state = (
                sb,
                container.to_owned(),
                offset,
                Vec::<vkd_provider::LogLine>::new(),
                false,
            );
            futures::stream::unfold(
                state,
                |(sb, name, mut offset, mut buf, mut ending)| async move {
                    loop {
                        if let Some(l) = buf.pop() {
                            return Some((l, (sb, name, offset, buf, ending)));
                        }
                        if ending {
                            return None;
                        }
                        let dir = sb.logs(&name);
                        let path = current(&dir);
                        let len = std::fs::metadata(&path).map_or(0, |m| m.len());
                        if len < offset {
                            offset = 0; // rotated, or a new run started
                        }
                        if let Ok((lines, next)) = read_file(&path, offset) {
                            offset = next;
                            buf = lines;
                            buf.reverse();
                        }
                        if buf.is_empty() {
                            let running = sb.read_status().ok().flatten().is_some_and(|s| {
                                s.containers
                                    .iter()
                                    .chain(&s.init)
                                    .chain(s.ephemeral.iter().flatten())
                                    .any(|c| {
                                        c.status.name == name
                                            && !matches!(
                                                c.status.state,
                                                ContainerState::Terminated(_)
                                            )
                                    })
                                    && !s.done
                            });
                            if !running {
                                // One last read after the container stopped, then the stream ends.
                                ending = true;
                                if let Ok((lines, next)) = read_file(&path, offset) {
                                    offset = next;
                                    buf = lines;
                                    buf.reverse();
                                }
                                continue;
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                },
            )
            .boxed()
        });
        Ok(Logs { history, follow })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_rotate() {
        let dir = std::env::temp_dir().join(format!("vkd-logs-{}", uuid::Uuid::new_v4()));
        let mut w = LogWriter::start_run(&dir, 20_000, false).unwrap();
        w.line("stdout", b"hello", true).unwrap();
        let long = vec![b'x'; MAX_LINE + 10];
        w.line("stderr", &long, true).unwrap();
        w.line("stdout", &long, true).unwrap();
        // The second long line went over the bound: the first file was rotated once.
        let (old, _) = read_file(&rotated(&dir), 0).unwrap();
        let (cur, _) = read_file(&current(&dir), 0).unwrap();
        assert!(!old.is_empty() && !cur.is_empty());
        let all: Vec<u8> = old
            .iter()
            .chain(&cur)
            .flat_map(|l| l.bytes.to_vec())
            .collect();
        let mut want = b"hello\n".to_vec();
        for _ in 0..2 {
            want.extend_from_slice(&long);
            want.push(b'\n');
        }
        assert_eq!(all, want);
        drop(w);
        let _w = LogWriter::start_run(&dir, 20_000, true).unwrap();
        let (prev, _) = read_file(&previous(&dir), 0).unwrap();
        assert!(
            !prev.is_empty(),
            "a restart keeps the last run as previous.log"
        );
        assert!(!rotated(&dir).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `kubectl logs --tail`, `--since-time` and `--limit-bytes` read only
    /// what they show: the tail from the files' ends (across the rotation),
    /// the limit from their start, since after the tail as the kubelet does.
    #[test]
    fn a_bounded_read_reads_what_it_shows() {
        let dir = std::env::temp_dir().join(format!("vkd-logs-{}", uuid::Uuid::new_v4()));
        // Small files: the 3,000 lines span a rotation and many 64 KiB blocks.
        let mut w = LogWriter::start_run(&dir, 200_000, false).unwrap();
        for i in 0..3000 {
            w.line(
                "stdout",
                format!("line {i:04} {}", "x".repeat(60)).as_bytes(),
                true,
            )
            .unwrap();
        }
        drop(w);
        assert!(rotated(&dir).exists());
        let files = [rotated(&dir), current(&dir)];
        let text = |lines: &[LogLine]| -> Vec<String> {
            lines
                .iter()
                .map(|l| String::from_utf8_lossy(&l.bytes[..9]).into_owned())
                .collect()
        };
        let (all, end) = read_within(&files, &LogRequest::default()).unwrap();
        assert_eq!(all.len(), 3000);
        assert_eq!(end, std::fs::metadata(current(&dir)).unwrap().len());
        let ask = |r: LogRequest| read_within(&files, &r).unwrap();
        let (tail, tail_end) = ask(LogRequest {
            tail_lines: Some(3),
            ..LogRequest::default()
        });
        assert_eq!(text(&tail), ["line 2997", "line 2998", "line 2999"]);
        assert_eq!(tail_end, end, "follow goes on from the end");
        // More than the current file holds: the rest comes from the rotated one.
        let cur = read_file(&current(&dir), 0).unwrap().0.len();
        let (long, _) = ask(LogRequest {
            tail_lines: Some(cur as u64 + 2),
            ..LogRequest::default()
        });
        assert_eq!(long.len(), cur + 2);
        assert_eq!(text(&long)[0], format!("line {:04}", 3000 - cur - 2));
        let (none, _) = ask(LogRequest {
            tail_lines: Some(0),
            ..LogRequest::default()
        });
        assert!(none.is_empty());
        let (head, _) = ask(LogRequest {
            limit_bytes: Some(100),
            ..LogRequest::default()
        });
        assert_eq!(text(&head), ["line 0000", "line 0001"]);
        let since = all[2990].time;
        let (recent, _) = ask(LogRequest {
            since: Some(since),
            tail_lines: Some(5),
            ..LogRequest::default()
        });
        assert!(recent.iter().all(|l| l.time >= since));
        assert_eq!(text(&recent).last().unwrap(), "line 2999");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tail_takes_the_last_lines_and_bytes() {
        let dir = std::env::temp_dir().join(format!("vkd-logs-{}", uuid::Uuid::new_v4()));
        assert!(tail(&dir, 80, 2048).is_empty(), "no log, no tail");
        let mut w = LogWriter::start_run(&dir, 1 << 20, false).unwrap();
        for i in 0..100 {
            w.line("stdout", format!("line {i}").as_bytes(), true)
                .unwrap();
        }
        w.line("stderr", b"DONE", false).unwrap();
        let t = String::from_utf8(tail(&dir, 80, 2048)).unwrap();
        assert!(
            t.starts_with("line 21\n") && t.ends_with("line 99\nDONE"),
            "{t}"
        );
        let t = tail(&dir, 80, 10);
        assert_eq!(t, b"ne 99\nDONE");
        // Past the size bound the lines before rotation still count.
        let mut w = LogWriter::start_run(&dir, 4096, true).unwrap();
        for i in 0..200 {
            w.line("stdout", format!("n{i}").as_bytes(), true).unwrap();
        }
        assert!(rotated(&dir).exists());
        let t = String::from_utf8(tail(&dir, 80, 4096)).unwrap();
        assert!(t.starts_with("n120\n") && t.ends_with("n199\n"), "{t}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn malformed_lines_are_skipped() {
        assert!(parse_line(b"not-a-time stdout F x\n").is_none());
        assert!(parse_line(b"").is_none());
        let l = parse_line(b"2026-01-01T00:00:00.000000001Z stdout P part").unwrap();
        assert_eq!(&l.bytes[..], b"part");
    }
}
