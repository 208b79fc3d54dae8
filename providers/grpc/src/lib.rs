//! The vkd provider protocol: the provider contract (vkd-provider) as a
//! versioned gRPC service (`proto/vkd/provider/v1/provider.proto`), so that a
//! backend runs in a process of its own, in any language.
//!
//! - [`server::serve`] puts any [`vkd_provider::Provider`] behind the protocol
//!   (a plugin written in Rust; `vkd provider-serve` for the in-tree ones);
//! - [`client::GrpcProvider`] is a provider that is such a plugin (`vkd run
//!   --provider grpc --provider-endpoint ...`).
//!
//! HTTP/2 over a Unix socket (0600, in a directory no one else can write,
//! and each side checks who the other is: [`socket`]), or TLS with mutual
//! authentication across machines ([`tls`]). Plain TCP is refused: it
//! authenticates no one, and a Pod that shares the host's network reaches
//! its loopback. docs/provider-protocol.md describes each call.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

pub mod client;
pub mod convert;
pub mod server;
pub mod socket;
pub mod tls;

pub use client::GrpcProvider;
pub use socket::SocketError;
pub use tls::TlsFiles;

/// The generated messages and service of `vkd.provider.v1`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("vkd.provider.v1");
}

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;

/// The largest message either side takes: a list of many thousand instances.
pub const MAX_MESSAGE: usize = 64 << 20;

/// How many bytes one stream frame carries at most.
const CHUNK: usize = 32 * 1024;

/// Sends what `from` gives, as the messages `wrap` makes, until it ends:
/// every byte pump of the streams, both sides. False when the receiver went
/// first.
async fn pump<R, T>(
    mut from: R,
    to: &tokio::sync::mpsc::Sender<T>,
    wrap: impl Fn(Vec<u8>) -> T,
) -> bool
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; CHUNK];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return true,
            Ok(n) => {
                if to.send(wrap(buf[..n].to_vec())).await.is_err() {
                    return false;
                }
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("provider endpoint {0:?}: {1}")]
    Endpoint(String, String),
    #[error("no provider plugin answers at {endpoint}: {why}")]
    Hello { endpoint: String, why: String },
    #[error("listening on {0}: {1}")]
    Bind(String, #[source] std::io::Error),
    #[error("serving the provider protocol: {0}")]
    Serve(String),
    #[error("provider protocol TLS: {0}")]
    Tls(String),
    #[error(transparent)]
    Socket(#[from] SocketError),
}

/// Where a plugin listens: `unix:///path/to.sock[?peer-uid=N]`, or
/// `tls://host:port?cert=<file>&key=<file>&ca=<file>` anywhere (this side's
/// certificate and key, and the CA the other side's must come from).
/// `tcp://` and `http://` are refused: they authenticate no one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `peer_uid`: one more uid, beside root and vkd's own, that the plugin
    /// at the other end may run as (its own account); only for dialling.
    Unix {
        path: PathBuf,
        peer_uid: Option<u32>,
    },
    Tls {
        host: String,
        port: u16,
        files: TlsFiles,
    },
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix {
                path,
                peer_uid: None,
            } => write!(f, "unix://{}", path.display()),
            Self::Unix {
                path,
                peer_uid: Some(uid),
            } => write!(f, "unix://{}?peer-uid={uid}", path.display()),
            Self::Tls { host, port, .. } => write!(f, "tls://{host}:{port}"),
        }
    }
}

/// `tls://host:port?cert=..&key=..&ca=..`, each file given once and absolute.
fn tls_endpoint(s: &str, rest: &str) -> Result<Endpoint, GrpcError> {
    let bad = |why: String| GrpcError::Endpoint(s.to_owned(), why);
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (host, port) = authority
        .trim_end_matches('/')
        .rsplit_once(':')
        .ok_or_else(|| bad("tls:// takes host:port".into()))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port
        .parse()
        .map_err(|_| bad(format!("{port:?} is not a port")))?;
    if host.is_empty() {
        return Err(bad("tls:// takes host:port".into()));
    }
    let (mut cert, mut key, mut ca) = (None, None, None);
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        let slot = match k.as_ref() {
            "cert" => &mut cert,
            "key" => &mut key,
            "ca" => &mut ca,
            other => return Err(bad(format!("unknown parameter {other:?}: cert, key, ca"))),
        };
        if !v.starts_with('/') {
            return Err(bad(format!("{k}: {v:?} must be an absolute path")));
        }
        if slot.replace(PathBuf::from(v.as_ref())).is_some() {
            return Err(bad(format!("{k} is given twice")));
        }
    }
    let need = |p: Option<PathBuf>, what: &str| {
        p.ok_or_else(|| bad(format!("mutual TLS needs {what}= (cert, key and ca)")))
    };
    Ok(Endpoint::Tls {
        host: host.to_owned(),
        port,
        files: TlsFiles {
            cert: need(cert, "cert")?,
            key: need(key, "key")?,
            ca: need(ca, "ca")?,
        },
    })
}

/// `unix:///path[?peer-uid=N]`.
fn unix_endpoint(s: &str, rest: &str) -> Result<Endpoint, GrpcError> {
    let bad = |why: String| GrpcError::Endpoint(s.to_owned(), why);
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if !path.starts_with('/') {
        return Err(bad(
            "a Unix socket's path must be absolute (unix:///run/x.sock)".into(),
        ));
    }
    let mut peer_uid = None;
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        if k != "peer-uid" {
            return Err(bad(format!("unknown parameter {k:?}: peer-uid")));
        }
        let uid: u32 = v
            .parse()
            .map_err(|_| bad(format!("peer-uid: {v:?} is not a numeric uid")))?;
        if peer_uid.replace(uid).is_some() {
            return Err(bad("peer-uid is given twice".into()));
        }
    }
    Ok(Endpoint::Unix {
        path: PathBuf::from(path),
        peer_uid,
    })
}

impl std::str::FromStr for Endpoint {
    type Err = GrpcError;

    fn from_str(s: &str) -> Result<Self, GrpcError> {
        let bad = |why: &str| GrpcError::Endpoint(s.to_owned(), why.to_owned());
        if let Some(rest) = s.strip_prefix("unix://") {
            return unix_endpoint(s, rest);
        }
        if let Some(rest) = s.strip_prefix("tls://") {
            return tls_endpoint(s, rest);
        }
        // Whoever reaches a plugin runs Pods through it and reads their
        // Secrets, and a Pod sharing the host's network reaches its
        // loopback: a transport that authenticates no one is refused.
        if s.starts_with("tcp://") || s.starts_with("http://") {
            return Err(bad(PLAIN_TCP));
        }
        Err(bad(
            "give unix:///path.sock or tls://host:port?cert=..&key=..&ca=.. (mutual TLS)",
        ))
    }
}

/// Why `tcp://` (and `http://`) is refused, on both sides.
const PLAIN_TCP: &str = "plain TCP is refused: it authenticates no peer, and any Pod that shares the host's network reaches it (even on 127.0.0.1); use unix:///path.sock, or tls://host:port?cert=..&key=..&ca=.. with mutual TLS";

impl Endpoint {
    /// `unix://path`, its plugin root or this process's user.
    pub fn unix(path: impl Into<PathBuf>) -> Self {
        Self::Unix {
            path: path.into(),
            peer_uid: None,
        }
    }

    /// A channel that connects when first used and again after a loss.
    fn channel(&self, timeout: Duration) -> Result<tonic::transport::Channel, GrpcError> {
        match self {
            Self::Tls { host, port, files } => {
                let connector = tokio_rustls::TlsConnector::from(files.client_config()?);
                let name = rustls_pki_types::ServerName::try_from(host.clone())
                    .map_err(|e| GrpcError::Endpoint(self.to_string(), e.to_string()))?;
                let (host, port) = (host.clone(), *port);
                Ok(
                    tonic::transport::Endpoint::from_static("http://plugin.invalid")
                        .connect_timeout(timeout)
                        .connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
                            let (connector, name, host) =
                                (connector.clone(), name.clone(), host.clone());
                            async move {
                                let tcp =
                                    tokio::net::TcpStream::connect((host.as_str(), port)).await?;
                                let tls = connector.connect(name, tcp).await?;
                                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
                            }
                        })),
                )
            }
            Self::Unix { path, peer_uid } => {
                let (path, peer_uid, shown) = (path.clone(), *peer_uid, self.to_string());
                // The URI is not dialled: the connector below is, and it
                // asks who listens on every (re)connect.
                Ok(
                    tonic::transport::Endpoint::from_static("http://plugin.invalid")
                        .connect_timeout(timeout)
                        .connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
                            let (path, shown) = (path.clone(), shown.clone());
                            async move {
                                let stream =
                                    socket::dial(&path, peer_uid, &shown).await.map_err(|e| {
                                        std::io::Error::new(std::io::ErrorKind::PermissionDenied, e)
                                    })?;
                                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                            }
                        })),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    #[test]
    fn endpoints_read_as_written_and_bad_ones_say_why() {
        assert_eq!(
            "unix:///run/vkd/p.sock".parse::<Endpoint>().unwrap(),
            Endpoint::unix("/run/vkd/p.sock")
        );
        let named = "unix:///run/vkd/p.sock?peer-uid=990"
            .parse::<Endpoint>()
            .unwrap();
        assert_eq!(
            named,
            Endpoint::Unix {
                path: "/run/vkd/p.sock".into(),
                peer_uid: Some(990)
            }
        );
        assert_eq!(named.to_string(), "unix:///run/vkd/p.sock?peer-uid=990");
        assert_eq!(
            "tls://plugin.example:7070?cert=/c.pem&key=/k.pem&ca=/ca%20dir/ca.pem"
                .parse::<Endpoint>()
                .unwrap(),
            Endpoint::Tls {
                host: "plugin.example".into(),
                port: 7070,
                files: TlsFiles {
                    cert: "/c.pem".into(),
                    key: "/k.pem".into(),
                    ca: "/ca dir/ca.pem".into(),
                },
            }
        );
        for bad in [
            "unix://relative.sock",
            "unix:///run/p.sock?peer-uid=vkd",
            "unix:///run/p.sock?peer-uid=1&peer-uid=2",
            "unix:///run/p.sock?uid=1",
            "grpc://x:1",
            "tls://plugin.example:7070",
            "tls://plugin.example:7070?cert=/c&key=/k",
            "tls://plugin.example:7070?cert=c&key=/k&ca=/a",
            "tls://plugin.example:7070?cert=/c&key=/k&ca=/a&ca=/b",
            "tls://plugin.example:7070?cert=/c&key=/k&ca=/a&pin=x",
            "tls://:7070?cert=/c&key=/k&ca=/a",
            "",
        ] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad}");
        }
    }

    #[test]
    fn plain_tcp_is_refused_even_on_loopback_saying_what_to_use() {
        for plain in [
            "tcp://127.0.0.1:7070",
            "tcp://[::1]:7070",
            "http://127.0.0.1:7070/",
            "tcp://0.0.0.0:7070",
            "tcp://host-name:1",
        ] {
            let e = plain.parse::<Endpoint>().unwrap_err().to_string();
            assert!(e.contains("plain TCP is refused"), "{plain}: {e}");
            assert!(
                e.contains("unix://") && e.contains("tls://") && e.contains("mutual TLS"),
                "{plain}: {e}"
            );
        }
    }
}
