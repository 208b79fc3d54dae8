//! TLS for httpGet probes and hooks with `scheme: HTTPS` and gRPC probes with
//! `mode: TLS`, as the kubelet makes it: the server's certificate is not
//! verified (the kubelet's `InsecureSkipVerify`), since a Pod serves a
//! certificate of its own that the node has no reason to trust; the
//! handshake's signatures still are.

use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A TLS session over `tcp` with `host`'s server.
pub(super) async fn connect(host: &str, tcp: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
    static CONNECTOR: OnceLock<Result<tokio_rustls::TlsConnector, String>> = OnceLock::new();
    session(&CONNECTOR, &[], host, tcp).await
}

/// A TLS session over `tcp` with `host`'s server that offers HTTP/2 (ALPN
/// `h2`), as gRPC servers require: a gRPC probe's with `mode: TLS`.
pub(super) async fn connect_h2(
    host: &str,
    tcp: TcpStream,
) -> std::io::Result<TlsStream<TcpStream>> {
    static CONNECTOR: OnceLock<Result<tokio_rustls::TlsConnector, String>> = OnceLock::new();
    session(&CONNECTOR, &[b"h2"], host, tcp).await
}

async fn session(
    connector: &OnceLock<Result<tokio_rustls::TlsConnector, String>>,
    alpn: &[&[u8]],
    host: &str,
    tcp: TcpStream,
) -> std::io::Result<TlsStream<TcpStream>> {
    let connector = connector
        .get_or_init(|| connector_offering(alpn))
        .clone()
        .map_err(std::io::Error::other)?;
    let name = ServerName::try_from(host.to_owned())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    connector.connect(name, tcp).await
}

fn connector_offering(alpn: &[&[u8]]) -> Result<tokio_rustls::TlsConnector, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// Accepts the server's certificate, whatever it is; checks that the server
/// holds its key.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
