//! TLS for the kubelet API: the serving certificate (from files, reloaded when
//! they change, or self-signed for the node address) and, with a client CA,
//! verification of client certificates. Clients without a certificate are still
//! let in, so that bearer tokens can authenticate them.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::RootCertStore;
use rustls::crypto::ring::default_provider;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {message}")]
    Read { path: String, message: String },
    #[error("TLS setup: {0}")]
    Setup(String),
}

fn read_err(path: &std::path::Path, e: impl std::fmt::Display) -> TlsError {
    TlsError::Read {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn load_key(cert: &std::path::Path, key: &std::path::Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| read_err(cert, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| read_err(cert, e))?;
    if certs.is_empty() {
        return Err(read_err(cert, "no certificate in the file"));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| read_err(key, e))?;
    let signing = default_provider()
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| read_err(key, e))?;
    Ok(Arc::new(CertifiedKey::new(certs, signing)))
}

fn mtimes(paths: &[PathBuf]) -> Vec<Option<SystemTime>> {
    paths
        .iter()
        .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .collect()
}

/// Serves the certificate in two files, loading them again when either changes.
#[derive(Debug)]
struct ReloadingResolver {
    paths: [PathBuf; 2],
    current: Mutex<(Vec<Option<SystemTime>>, Arc<CertifiedKey>)>,
}

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl ReloadingResolver {
    /// The certificate to serve now, reloading it first if either file changed.
    fn current(&self) -> Arc<CertifiedKey> {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let now = mtimes(&self.paths);
        if now != cur.0 {
            match load_key(&self.paths[0], &self.paths[1]) {
                Ok(key) => {
                    tracing::info!(cert = %self.paths[0].display(), "serving certificate reloaded");
                    *cur = (now, key);
                }
                // Keep serving the old one; a half-written pair must not break TLS.
                Err(e) => {
                    tracing::warn!(error = %e, "serving certificate changed but does not load; keeping the old one")
                }
            }
        }
        Arc::clone(&cur.1)
    }
}

#[derive(Debug)]
struct FixedResolver(Arc<CertifiedKey>);

impl ResolvesServerCert for FixedResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }
}

/// A self-signed certificate for the node's name and address.
fn self_signed(nodes: &[&str], address: IpAddr) -> Result<Arc<CertifiedKey>, TlsError> {
    let mut sans: Vec<String> = nodes.iter().map(|n| (*n).to_owned()).collect();
    sans.extend([address.to_string(), "localhost".to_owned()]);
    let ck =
        rcgen::generate_simple_self_signed(sans).map_err(|e| TlsError::Setup(e.to_string()))?;
    let key = PrivateKeyDer::try_from(ck.signing_key.serialize_der())
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    let signing = default_provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    Ok(Arc::new(CertifiedKey::new(
        vec![ck.cert.der().clone()],
        signing,
    )))
}

#[derive(Clone, Debug, Default)]
pub struct TlsSettings {
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub client_ca_file: Option<PathBuf>,
}

/// Builds the rustls server configuration of a listener serving `nodes` (a
/// self-signed certificate, when no files are given, names each).
pub fn server_config(
    s: &TlsSettings,
    nodes: &[&str],
    address: IpAddr,
) -> Result<rustls::ServerConfig, TlsError> {
    let provider = Arc::new(default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    let builder = match &s.client_ca_file {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(ca).map_err(|e| read_err(ca, e))? {
                roots
                    .add(cert.map_err(|e| read_err(ca, e))?)
                    .map_err(|e| read_err(ca, e))?;
            }
            if roots.is_empty() {
                return Err(read_err(ca, "no CA certificate in the file"));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::Setup(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let resolver: Arc<dyn ResolvesServerCert> = match (&s.cert_file, &s.key_file) {
        (Some(cert), Some(key)) => {
            let paths = [cert.clone(), key.clone()];
            let loaded = load_key(cert, key)?;
            Arc::new(ReloadingResolver {
                current: Mutex::new((mtimes(&paths), loaded)),
                paths,
            })
        }
        (None, None) => Arc::new(FixedResolver(self_signed(nodes, address)?)),
        _ => {
            return Err(TlsError::Setup(
                "--tls-cert-file and --tls-private-key-file go together".into(),
            ));
        }
    };
    let mut config = builder.with_cert_resolver(resolver);
    // HTTP/2 first, as the kubelet's Go server offers it: the apiserver's
    // transport takes it for logs, stats and the rest. Exec, attach and
    // port-forward are connection upgrades, which HTTP/2 cannot carry: the
    // clients that make them offer http/1.1 alone.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// The user a verified client certificate names: CN, and O as groups.
pub fn identity_of(cert: &CertificateDer<'_>) -> Option<(String, Vec<String>)> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let subject = parsed.subject();
    let name = subject.iter_common_name().next()?.as_str().ok()?.to_owned();
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok().map(str::to_owned))
        .collect();
    Some((name, groups))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_config_builds() {
        let c = server_config(
            &TlsSettings::default(),
            &["vk-1"],
            IpAddr::from([127, 0, 0, 1]),
        )
        .unwrap();
        assert_eq!(c.alpn_protocols, vec![b"h2".to_vec(), b"http/1.1".to_vec()]);
    }

    #[test]
    fn identity_from_certificate() {
        let mut params = rcgen::CertificateParams::new(vec![]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "kube-apiserver-kubelet-client");
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "system:masters");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let (name, groups) = identity_of(cert.der()).unwrap();
        assert_eq!(name, "kube-apiserver-kubelet-client");
        assert_eq!(groups, ["system:masters"]);
    }

    fn write_pair(dir: &std::path::Path, name: &str) -> Vec<u8> {
        let ck = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
        std::fs::write(dir.join("tls.crt"), ck.cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), ck.signing_key.serialize_pem()).unwrap();
        ck.cert.der().to_vec()
    }

    #[test]
    fn certificate_files_are_reloaded_when_they_change() {
        let dir = std::env::temp_dir().join(format!("vkd-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = write_pair(&dir, "first.example");
        let paths = [dir.join("tls.crt"), dir.join("tls.key")];
        let r = ReloadingResolver {
            current: Mutex::new((mtimes(&paths), load_key(&paths[0], &paths[1]).unwrap())),
            paths: paths.clone(),
        };
        assert_eq!(r.current().cert[0].as_ref(), &first[..]);
        // A later modification time, as a rotation by cert-manager or a kubelet would give.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let second = write_pair(&dir, "second.example");
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        for p in &paths {
            std::fs::File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_modified(later)
                .unwrap();
        }
        assert_eq!(r.current().cert[0].as_ref(), &second[..]);
        // A broken file keeps the last good certificate.
        std::fs::write(&paths[0], "not a certificate").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&paths[0])
            .unwrap()
            .set_modified(later + std::time::Duration::from_secs(5))
            .unwrap();
        assert_eq!(r.current().cert[0].as_ref(), &second[..]);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn missing_files_are_named() {
        let s = TlsSettings {
            cert_file: Some("/nonexistent/tls.crt".into()),
            key_file: Some("/nonexistent/tls.key".into()),
            client_ca_file: None,
        };
        let e = server_config(&s, &["vk"], IpAddr::from([127, 0, 0, 1])).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tls.crt"), "{e}");
    }
}
