//! Logs, exec and port-forward into a Pod's Slurm job: logs are the CRI log
//! files the job's steps write into the Pod's directory; exec and
//! port-forward are job steps of their own (`srun --jobid=<job> --overlap`),
//! so they run where the job runs, inside its allocation.

use std::io::{BufRead, Read, Seek};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vkd_provider::{
    BoxRead, BoxWrite, Duplex, LogLine, LogRequest, Logs, ProviderError, Result, StreamIo, TermSize,
};

use crate::pod_dir::PodDir;

/// How often a followed log is read for more.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// One CRI log line: `<RFC 3339> <stream> <F|P> <content>`.
fn parse_line(line: &[u8]) -> Option<LogLine> {
    let text = line.strip_suffix(b"\n").unwrap_or(line);
    let mut parts = text.splitn(4, |b| *b == b' ');
    let time: jiff::Timestamp = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
    let _stream = parts.next()?;
    let tag = parts.next()?;
    let content = parts.next().unwrap_or_default();
    let mut bytes = content.to_vec();
    if tag == b"F" {
        bytes.push(b'\n');
    }
    Some(LogLine {
        time: SystemTime::from(time),
        bytes: bytes.into(),
    })
}

/// The most of a log read at once: the history shows the lines of its last
/// 64 MiB (as a kubelet shows what its rotation kept), and a follow reads
/// on from there.
const READ_MAX: u64 = 64 << 20;
/// The longest log line read: the runner writes at most 16 KiB of content a
/// line (longer output is split into partial lines, as the kubelet's CRI
/// logs are); anything longer was not written by it and is skipped.
const LINE_MAX: u64 = 64 << 10;

/// The complete lines of a file from `offset` (or from its last
/// [`READ_MAX`] bytes, when that is later), and the offset after them.
fn read_from(path: &Path, offset: u64) -> std::io::Result<(Vec<LogLine>, u64)> {
    let (f, len) = match crate::pod_dir::open_regular(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), offset)),
        Err(e) => return Err(e),
    };
    // Past the last READ_MAX bytes: read from the byte before them, and skip
    // what ends at the first newline (the rest of a line, or that newline
    // alone when the window starts a line).
    let window = len.saturating_sub(READ_MAX);
    let (start, mut inside) = if window > offset {
        (window - 1, true)
    } else {
        (offset, false)
    };
    let mut reader = std::io::BufReader::new(f);
    reader.seek(std::io::SeekFrom::Start(start))?;
    let (mut lines, mut at, mut buf) = (Vec::new(), start, Vec::new());
    // A file that grows while it is read is read on next time.
    let end = start.saturating_add(READ_MAX);
    while at < end {
        buf.clear();
        let n = (&mut reader).take(LINE_MAX).read_until(b'\n', &mut buf)?;
        let whole = buf.last() == Some(&b'\n');
        if n == 0 || (!whole && (n as u64) < LINE_MAX) {
            // The end of what was written so far: a line still being written
            // is read whole next time.
            return Ok((lines, at));
        }
        at += n as u64;
        if whole && !inside {
            lines.extend(parse_line(&buf));
        }
        inside = !whole;
    }
    Ok((lines, at))
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> ProviderError + '_ {
    move |e| ProviderError::transient(format!("{}: {e}", path.display()))
}

/// A container's log: its history (the tail and since asked for; vkd bounds
/// it again with the limit), then, when followed, what it writes until it
/// stops running.
pub(crate) fn logs(pod: &PodDir, container: &str, request: LogRequest) -> Result<Logs> {
    let path = if request.previous {
        pod.previous_log(container)
    } else {
        pod.log(container)
    };
    let (mut history, offset) = read_from(&path, 0).map_err(io_error(&path))?;
    if let Some(since) = request.since {
        history.retain(|l| l.time >= since);
    }
    if let Some(n) = request.tail_lines {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        history.drain(..history.len().saturating_sub(n));
    }
    let follow = (request.follow && !request.previous).then(|| {
        let (pod, container) = (pod.clone(), container.to_owned());
        futures::stream::unfold((offset, false), move |(mut offset, done)| {
            let (pod, container, path) = (pod.clone(), container.clone(), path.clone());
            async move {
                if done {
                    return None;
                }
                loop {
                    let running = pod.record(&container).running_since.is_some();
                    let (lines, at) = read_from(&path, offset).ok()?;
                    offset = at;
                    if !lines.is_empty() {
                        return Some((futures::stream::iter(lines), (offset, !running)));
                    }
                    if !running || !pod.exists() {
                        return None;
                    }
                    tokio::time::sleep(FOLLOW_POLL).await;
                }
            }
        })
        .flatten()
        .boxed()
    });
    Ok(Logs { history, follow })
}

/// The `srun` that runs one more step in a running job; `export` is what
/// the step's environment starts with (the batch script's), never the
/// provider's own environment.
pub(crate) fn step(job: u64, tty: bool, runner: &Path, export: &str) -> tokio::process::Command {
    let mut srun = tokio::process::Command::new("srun");
    srun.args([
        format!("--jobid={job}"),
        format!("--export={export}"),
        "--overlap".into(),
        "--nodes=1".into(),
        "--ntasks=1".into(),
        "--quiet".into(),
    ]);
    if tty {
        srun.arg("--pty");
    }
    srun.arg(runner).kill_on_drop(true);
    srun
}

async fn copy_in(from: Option<BoxRead>, to: Option<tokio::process::ChildStdin>) {
    if let (Some(mut from), Some(mut to)) = (from, to) {
        let _ = tokio::io::copy(&mut from, &mut to).await;
        let _ = to.shutdown().await;
    }
}

async fn copy_out(from: Option<impl tokio::io::AsyncRead + Unpin>, to: Option<BoxWrite>) {
    match (from, to) {
        (Some(mut from), Some(mut to)) => {
            let _ = tokio::io::copy(&mut from, &mut to).await;
            let _ = to.flush().await;
        }
        (Some(mut from), None) => {
            let _ = tokio::io::copy(&mut from, &mut tokio::io::sink()).await;
        }
        _ => {}
    }
}

/// Runs `srun` with the caller's streams; its exit code (the command's).
pub(crate) async fn run_step(
    mut srun: tokio::process::Command,
    stdin: Option<BoxRead>,
    stdout: Option<BoxWrite>,
    stderr: Option<BoxWrite>,
) -> Result<i32> {
    srun.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = srun
        .spawn()
        .map_err(|e| ProviderError::transient(format!("srun: {e}")))?;
    let feed = tokio::spawn(copy_in(stdin, child.stdin.take()));
    let out = copy_out(child.stdout.take(), stdout);
    let err = copy_out(child.stderr.take(), stderr);
    let (status, (), ()) = tokio::join!(child.wait(), out, err);
    feed.abort();
    status
        .map(status_code)
        .map_err(|e| ProviderError::transient(format!("srun: {e}")))
}

pub(crate) fn status_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(128)
}

/// Runs `srun --pty` on a terminal of its own here (srun gives the step a
/// terminal only when it has one): the caller's stdin and resizes go in,
/// the terminal's output comes back as stdout; the command's exit code.
pub(crate) async fn run_step_on_a_tty(srun: tokio::process::Command, io: StreamIo) -> Result<i32> {
    let fail = |e: pty_process::Error| ProviderError::transient(format!("exec with a tty: {e}"));
    let std = srun.as_std();
    let mut cmd = pty_process::Command::new(std.get_program()).args(std.get_args());
    for (key, value) in std.get_envs() {
        if let Some(value) = value {
            cmd = cmd.env(key, value);
        }
    }
    let (pty, pts) = pty_process::open().map_err(fail)?;
    let mut resize = io.resize;
    // kubectl sends the terminal's size first: the step starts with it.
    if let Some(r) = resize.as_mut()
        && let Ok(Some(size)) = tokio::time::timeout(Duration::from_millis(50), r.recv()).await
    {
        let _ = pty.resize(pty_process::Size::new(size.height, size.width));
    }
    let mut child = cmd.spawn(pts).map_err(fail)?;
    let (mut from_tty, mut to_tty) = pty.into_split();
    let mut stdin = io.stdin;
    let input = tokio::spawn(async move {
        let mut buf = vec![0u8; 8192];
        loop {
            let read = async {
                match stdin.as_mut() {
                    Some(s) => Some(s.read(&mut buf).await),
                    None => std::future::pending().await,
                }
            };
            let size = async {
                match resize.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending::<Option<TermSize>>().await,
                }
            };
            tokio::select! {
                Some(n) = read => match n {
                    Ok(n) if n > 0 => {
                        if to_tty.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                    _ => stdin = None,
                },
                s = size => match s {
                    Some(s) => {
                        let _ = to_tty.resize(pty_process::Size::new(s.height, s.width));
                    }
                    None => resize = None,
                },
            }
            if stdin.is_none() && resize.is_none() {
                return;
            }
        }
    });
    let output = async {
        let mut out = io.stdout;
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = from_tty.read(&mut buf).await {
            if n == 0 {
                break;
            }
            if let Some(o) = out.as_mut()
                && (o.write_all(&buf[..n]).await.is_err() || o.flush().await.is_err())
            {
                break;
            }
        }
    };
    let ((), status) = tokio::join!(output, child.wait());
    input.abort();
    status
        .map(status_code)
        .map_err(|e| ProviderError::transient(format!("srun: {e}")))
}

/// Carries one port-forward connection through a step that connects to
/// `port` on the job's node.
pub(crate) async fn forward(
    mut srun: tokio::process::Command,
    stream: Box<dyn Duplex>,
) -> Result<()> {
    srun.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = srun
        .spawn()
        .map_err(|e| ProviderError::transient(format!("srun: {e}")))?;
    let (mut read, mut write) = tokio::io::split(stream);
    let (Some(mut to), Some(mut from)) = (child.stdin.take(), child.stdout.take()) else {
        return Err(ProviderError::transient("srun: no pipes"));
    };
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut read, &mut to).await;
        let _ = to.shutdown().await;
    });
    let _ = tokio::io::copy(&mut from, &mut write).await;
    let _ = write.shutdown().await;
    up.abort();
    let _ = child.kill().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_lines_keep_their_time_and_a_partial_line_stays_partial() {
        let full = parse_line(b"2026-12-07T03:11:06.123456789Z stdout F hello world\n").unwrap();
        assert_eq!(&full.bytes[..], b"hello world\n");
        let part = parse_line(b"2026-12-07T03:11:06Z stderr P abc\n").unwrap();
        assert_eq!(&part.bytes[..], b"abc");
        assert!(parse_line(b"not a log line\n").is_none());
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("vkd-slurm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    fn line(text: &str) -> String {
        format!("2026-12-07T03:11:06Z stdout F {text}\n")
    }

    #[test]
    fn a_log_is_read_in_whole_lines_and_overlong_ones_are_skipped() {
        let dir = scratch("read");
        let log = dir.join("main.log");
        let long = "x".repeat(usize::try_from(LINE_MAX).expect("small") * 2);
        let text = format!("{}{}{}2026-12-07T03", line("one"), line(&long), line("two"));
        std::fs::write(&log, &text).expect("log");
        let (lines, at) = read_from(&log, 0).expect("read");
        let got: Vec<&[u8]> = lines.iter().map(|l| &l.bytes[..]).collect();
        assert_eq!(got, [&b"one\n"[..], b"two\n"]);
        // The line still being written is left for the next read.
        assert_eq!(at, text.len() as u64 - "2026-12-07T03".len() as u64);
        let (more, _) = read_from(&log, at).expect("read on");
        assert!(more.is_empty());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_log_that_is_a_link_or_a_fifo_is_not_read() {
        let dir = scratch("links");
        let secret = dir.join("secret");
        std::fs::write(&secret, line("secret")).expect("secret");
        let link = dir.join("main.log");
        std::os::unix::fs::symlink(&secret, &link).expect("link");
        assert!(read_from(&link, 0).is_err());
        let fifo = dir.join("fifo.log");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo");
        assert!(made.success());
        // Refused at once: never a read that waits for a writer.
        assert!(read_from(&fifo, 0).is_err());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
