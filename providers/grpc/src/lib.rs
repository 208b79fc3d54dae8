//! The vkd provider protocol: the provider contract (vkd-provider) as a
//! versioned gRPC service (`proto/vkd/provider/v1/provider.proto`), so that a
//! backend runs in a process of its own, in any language.
//!
//! - [`server::serve`] puts any [`vkd_provider::Provider`] behind the protocol
//!   (a plugin written in Rust; `vkd provider-serve` for the in-tree ones);
//! - [`client::GrpcProvider`] is a provider that is such a plugin (`vkd run
//!   --provider grpc --provider-endpoint ...`).
//!
//! HTTP/2 over a Unix socket (the socket file's permissions say who may
//! speak), TCP on loopback, or TLS with mutual authentication across
//! machines ([`tls`]). docs/provider-protocol.md describes each call.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub mod client;
pub mod convert;
pub mod server;
pub mod tls;

pub use client::GrpcProvider;
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
}

/// Where a plugin listens: `unix:///path/to.sock`, `tcp://ip:port` on a
/// loopback address (`http://ip:port` is read as the same), or
/// `tls://host:port?cert=<file>&key=<file>&ca=<file>` anywhere (this side's
/// certificate and key, and the CA the other side's must come from).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(SocketAddr),
    Tls {
        host: String,
        port: u16,
        files: TlsFiles,
    },
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix://{}", p.display()),
            Self::Tcp(a) => write!(f, "tcp://{a}"),
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

impl std::str::FromStr for Endpoint {
    type Err = GrpcError;

    fn from_str(s: &str) -> Result<Self, GrpcError> {
        let bad = |why: &str| GrpcError::Endpoint(s.to_owned(), why.to_owned());
        if let Some(path) = s.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(bad(
                    "a Unix socket's path must be absolute (unix:///run/x.sock)",
                ));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        if let Some(rest) = s.strip_prefix("tls://") {
            return tls_endpoint(s, rest);
        }
        let rest = s
            .strip_prefix("tcp://")
            .or_else(|| s.strip_prefix("http://"))
            .ok_or_else(|| bad("give unix:///path, tcp://127.0.0.1:port or tls://host:port?cert=..&key=..&ca=.."))?;
        let addr: SocketAddr = rest
            .trim_end_matches('/')
            .parse()
            .map_err(|_| bad("tcp:// takes an IP address and a port"))?;
        // Whoever reaches a plugin may run Pods through it: without mutual
        // TLS, only this machine may.
        if !addr.ip().is_loopback() {
            return Err(bad(
                "tcp:// is for a loopback address only (it has no authentication); use tls:// with mutual TLS, unix://, or 127.0.0.1",
            ));
        }
        Ok(Self::Tcp(addr))
    }
}

impl Endpoint {
    /// A channel that connects when first used and again after a loss.
    fn channel(&self, timeout: Duration) -> Result<tonic::transport::Channel, GrpcError> {
        let bad = |e: tonic::transport::Error| GrpcError::Endpoint(self.to_string(), e.to_string());
        match self {
            Self::Tcp(addr) => Ok(tonic::transport::Endpoint::from_shared(format!(
                "http://{addr}"
            ))
            .map_err(bad)?
            .connect_timeout(timeout)
            .connect_lazy()),
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
            Self::Unix(path) => {
                let path = path.clone();
                // The URI is not dialled: the connector below is.
                Ok(
                    tonic::transport::Endpoint::from_static("http://plugin.invalid")
                        .connect_timeout(timeout)
                        .connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
                            let path = path.clone();
                            async move {
                                let stream = tokio::net::UnixStream::connect(path).await?;
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
            Endpoint::Unix("/run/vkd/p.sock".into())
        );
        assert_eq!(
            "tcp://127.0.0.1:7070"
                .parse::<Endpoint>()
                .unwrap()
                .to_string(),
            "tcp://127.0.0.1:7070"
        );
        assert!("http://127.0.0.1:7070/".parse::<Endpoint>().is_ok());
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
            "grpc://x:1",
            "tcp://host-name:1",
            "tcp://0.0.0.0:7070",
            "tcp://10.0.0.5:7070",
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
}
