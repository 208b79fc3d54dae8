//! Mutual TLS for the protocol across machines: `tls://host:port?cert=..&key=..&ca=..`.
//! Both sides present a certificate and accept only the other's CA: vkd
//! checks that the plugin's certificate names the host it dialled, the
//! plugin accepts only clients whose certificate its `ca` signed (whoever
//! reaches a plugin can run Pods through it). HTTP/2 is agreed by ALPN, as
//! every gRPC implementation expects.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::RootCertStore;
use rustls::crypto::ring::default_provider;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;

use crate::GrpcError;

/// How long a client has to finish its handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// One side's certificate and key, and the CA it accepts the other side's from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

fn unreadable(path: &Path, e: impl std::fmt::Display) -> GrpcError {
    GrpcError::Tls(format!("{}: {e}", path.display()))
}

impl TlsFiles {
    fn chain(&self) -> Result<Vec<CertificateDer<'static>>, GrpcError> {
        let certs: Vec<_> = CertificateDer::pem_file_iter(&self.cert)
            .map_err(|e| unreadable(&self.cert, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| unreadable(&self.cert, e))?;
        if certs.is_empty() {
            return Err(unreadable(&self.cert, "no certificate in the file"));
        }
        Ok(certs)
    }

    fn private_key(&self) -> Result<PrivateKeyDer<'static>, GrpcError> {
        PrivateKeyDer::from_pem_file(&self.key).map_err(|e| unreadable(&self.key, e))
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, GrpcError> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca).map_err(|e| unreadable(&self.ca, e))? {
            roots
                .add(cert.map_err(|e| unreadable(&self.ca, e))?)
                .map_err(|e| unreadable(&self.ca, e))?;
        }
        if roots.is_empty() {
            return Err(unreadable(&self.ca, "no CA certificate in the file"));
        }
        Ok(Arc::new(roots))
    }

    /// What a plugin serves with: its certificate, and clients' required.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, GrpcError> {
        let provider = Arc::new(default_provider());
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots()?, Arc::clone(&provider))
                .build()
                .map_err(|e| GrpcError::Tls(e.to_string()))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| GrpcError::Tls(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain()?, self.private_key()?)
            .map_err(|e| unreadable(&self.key, e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }

    /// What vkd dials with: its certificate, and the plugin's checked.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, GrpcError> {
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| GrpcError::Tls(e.to_string()))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain()?, self.private_key()?)
            .map_err(|e| unreadable(&self.key, e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// A client's connection once its handshake is done.
#[derive(Debug)]
pub(crate) struct Accepted(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for Accepted {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Accepted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The connections of clients that completed the handshake; one that did
/// not (no certificate, another CA, too slow) is dropped and logged.
pub(crate) fn accept(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
    shutdown: CancellationToken,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<Accepted>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = shutdown.cancelled() => return,
                a = listener.accept() => match a {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a provider protocol connection");
                        continue;
                    }
                },
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(Accepted(tls))).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "refused a client: TLS handshake")
                    }
                    Err(_) => tracing::warn!(%peer, "refused a client: no TLS handshake in 10s"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
