//! Helpers for exec: copying output and running a command on a pty.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vkd_provider::{ProviderError, Result, StreamIo};

pub(crate) async fn copy_out(
    from: Option<impl tokio::io::AsyncRead + Unpin>,
    to: Option<vkd_provider::BoxWrite>,
) {
    let Some(mut from) = from else { return };
    match to {
        Some(mut to) => {
            let _ = tokio::io::copy(&mut from, &mut to).await;
            let _ = to.flush().await;
        }
        None => {
            let _ = tokio::io::copy(&mut from, &mut tokio::io::sink()).await;
        }
    }
}

pub(crate) async fn exec_tty(cmd: std::process::Command, io: StreamIo) -> Result<i32> {
    let e = |e: pty_process::Error| ProviderError::transient(format!("exec with a tty: {e}"));
    let (pty, pts) = pty_process::open().map_err(e)?;
    let mut pcmd = pty_process::Command::new(cmd.get_program()).args(cmd.get_args());
    pcmd = pcmd.env_clear();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            pcmd = pcmd.env(k, v);
        }
    }
    if let Some(d) = cmd.get_current_dir() {
        pcmd = pcmd.current_dir(d);
    }
    let mut rx = io.resize;
    if let Some(rx) = rx.as_mut()
        && let Ok(Some(size)) = tokio::time::timeout(Duration::from_millis(50), rx.recv()).await
    {
        let _ = pty.resize(pty_process::Size::new(size.height, size.width));
    }
    let mut child = pcmd.spawn(pts).map_err(e)?;
    let (mut read, mut write) = pty.into_split();
    let mut stdin = io.stdin;
    let feed = tokio::spawn(async move {
        let mut buf = vec![0u8; 8192];
        while stdin.is_some() || rx.is_some() {
            tokio::select! {
                n = async {
                    match stdin.as_mut() {
                        Some(s) => s.read(&mut buf).await,
                        None => std::future::pending().await,
                    }
                } => match n {
                    Ok(0) | Err(_) => stdin = None,
                    Ok(n) => {
                        if write.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                },
                size = async {
                    match rx.as_mut() {
                        Some(r) => r.recv().await,
                        None => std::future::pending().await,
                    }
                } => match size {
                    Some(s) => {
                        let _ = write.resize(pty_process::Size::new(s.height, s.width));
                    }
                    None => rx = None,
                },
            }
        }
    });
    let out = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut stdout = io.stdout;
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if let Some(o) = stdout.as_mut() {
                        if o.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        let _ = o.flush().await;
                    }
                }
            }
        }
    };
    let (_, status) = tokio::join!(out, child.wait());
    feed.abort();
    let status = status.map_err(|e| ProviderError::transient(format!("waiting for exec: {e}")))?;
    Ok(crate::procfs::exit_code(status))
}
