//! Where the network actions of probes and hooks (httpGet, tcpSocket, gRPC)
//! connect from. A Pod with a network namespace of its own (the provider's
//! `network`) is reached from inside it, so `127.0.0.1` is the Pod's own
//! loopback and never the node's (vkd's admin port, etcd): a thread of its
//! own enters the namespace, connects and ends, and the socket keeps the
//! namespace it was made in. Without one, from the shim's (the host's), as
//! the kubelet's prober connects. Entering never falls back to the host's
//! network: a namespace that cannot be entered fails the action.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::TcpStream;

use crate::network::connect_in;

/// Why a connection was not made.
#[derive(Debug, thiserror::Error)]
pub(super) enum DialError {
    /// The Pod's network namespace could not be entered: nothing was tried
    /// from anywhere else.
    #[error("entering the Pod's network namespace {}: {source}", path.display())]
    Namespace {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Connect(#[from] std::io::Error),
}

impl DialError {
    /// In the words of Go's net package, as the kubelet's Events give a
    /// failed dial to `host:port` (`dial tcp 10.0.0.5:80: connect: connection
    /// refused`); a namespace that could not be entered as itself.
    pub(super) fn go_text(&self, host: &str, port: u16) -> String {
        match self {
            Self::Namespace { .. } => self.to_string(),
            Self::Connect(e) => format!(
                "dial tcp {}: {}",
                super::handler::authority(host, port),
                super::handler::io_text(e)
            ),
        }
    }
}

/// A TCP connection to `host:port`: from inside the network namespace at
/// `netns` when there is one (the connect bounded by `timeout` there, as a
/// thread cannot be cancelled), else from the shim's own.
pub(super) async fn dial(
    netns: Option<&Path>,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<TcpStream, DialError> {
    let Some(netns) = netns else {
        return Ok(TcpStream::connect((host, port)).await?);
    };
    // Named hosts are resolved here, as the kubelet resolves them (the
    // host's resolver: a Pod's namespace may not reach a loopback one);
    // only the connection is made from inside.
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host, port)).await?.collect();
    if addrs.is_empty() {
        return Err(DialError::Connect(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("lookup {host}: no such host"),
        )));
    }
    let path = netns.to_owned();
    let entered = tokio::task::spawn_blocking(move || connect_in(&path, &addrs, timeout))
        .await
        .map_err(|_| std::io::Error::other("the connecting thread ended without an answer"))?;
    let stream = entered.map_err(|source| DialError::Namespace {
        path: netns.to_owned(),
        source,
    })??;
    stream.set_nonblocking(true)?;
    Ok(TcpStream::from_std(stream)?)
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;

    use super::*;

    /// A network namespace of the test's own with its loopback up and a
    /// listener on its `127.0.0.1:port` (a port the caller holds on the
    /// host's loopback, so no other test is given it): the namespace's path
    /// (held by the returned file) and the listener. `None` (with the reason
    /// printed) where the test cannot make one: not root, or no `ip` to
    /// bring `lo` up.
    pub(in crate::shim) fn namespace_with_listener(
        port: u16,
    ) -> Option<(std::fs::File, PathBuf, std::net::TcpListener)> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: making a network namespace needs root");
            return None;
        }
        let made = std::thread::spawn(move || -> std::io::Result<_> {
            unshare_net()?;
            // A child started by this thread is in its namespace.
            let up = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()?;
            if !up.success() {
                return Err(std::io::Error::other(format!("ip link set lo up: {up}")));
            }
            let listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
            let ns = std::fs::File::open("/proc/thread-self/ns/net")?;
            Ok((ns, listener))
        })
        .join()
        .expect("the namespace thread");
        let (ns, listener) = match made {
            Ok(m) => m,
            Err(e) => {
                eprintln!("skipped: a network namespace with its loopback up: {e}");
                return None;
            }
        };
        let path = PathBuf::from(format!("/proc/self/fd/{}", ns.as_raw_fd()));
        Some((ns, path, listener))
    }

    #[allow(unsafe_code)]
    fn unshare_net() -> std::io::Result<()> {
        // SAFETY: NEWNET only changes the calling thread's network namespace.
        unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }
            .map_err(Into::into)
    }

    /// Accepts one connection on `listener` (nonblocking, for at most
    /// `wait`) and answers it with `reply`; whether one came.
    pub(in crate::shim) fn answer_one(
        listener: &std::net::TcpListener,
        wait: Duration,
        reply: &'static [u8],
    ) -> bool {
        listener.set_nonblocking(true).unwrap();
        let until = std::time::Instant::now() + wait;
        loop {
            match listener.accept() {
                Ok((mut c, _)) => {
                    c.set_nonblocking(false).unwrap();
                    c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let mut buf = [0u8; 4096];
                    let _ = c.read(&mut buf);
                    let _ = c.write_all(reply);
                    return true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if std::time::Instant::now() >= until {
                        return false;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        }
    }

    /// `127.0.0.1` from a Pod's namespace is the Pod's loopback: the
    /// listener inside is reached, one on the host's loopback at the same
    /// port is not.
    #[tokio::test]
    async fn loopback_in_a_pod_namespace_is_the_pods_own() {
        let host_side = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        host_side.set_nonblocking(true).unwrap();
        let port = host_side.local_addr().unwrap().port();
        let Some((_ns, path, inside)) = namespace_with_listener(port) else {
            return;
        };
        let mut s = dial(Some(&path), "127.0.0.1", port, Duration::from_secs(2))
            .await
            .unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut s, b"x")
            .await
            .unwrap();
        inside.set_nonblocking(false).unwrap();
        let (mut c, _) = inside.accept().unwrap();
        let mut b = [0u8; 1];
        c.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
        assert_eq!(
            host_side.accept().map_err(|e| e.kind()).err(),
            Some(std::io::ErrorKind::WouldBlock),
            "the host's loopback was reached"
        );
        // The shim's own thread stayed in the host's namespace.
        assert!(
            dial(None, "127.0.0.1", port, Duration::from_secs(2))
                .await
                .is_ok()
        );
        host_side.accept().unwrap();
    }

    /// A namespace that cannot be entered fails the dial with its path; no
    /// connection is tried from the host's network instead.
    #[tokio::test]
    async fn a_namespace_that_cannot_be_entered_is_a_failure_not_the_host() {
        let host_side = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        host_side.set_nonblocking(true).unwrap();
        let port = host_side.local_addr().unwrap().port();
        let missing = Path::new("/nonexistent/netns/pod-uid");
        let e = dial(Some(missing), "127.0.0.1", port, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(e, DialError::Namespace { .. }), "{e:?}");
        assert!(
            e.to_string()
                .starts_with("entering the Pod's network namespace /nonexistent/netns/pod-uid: "),
            "{e}"
        );
        // A file that is no namespace is refused by setns as well.
        let e = dial(
            Some(Path::new("/proc/self/status")),
            "127.0.0.1",
            port,
            Duration::from_secs(1),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, DialError::Namespace { .. }), "{e:?}");
        assert_eq!(
            host_side.accept().map_err(|e| e.kind()).err(),
            Some(std::io::ErrorKind::WouldBlock)
        );
    }
}
