//! `vkd provider-serve` and `vkd provider-conformance`: the provider protocol
//! from the command line (docs/provider-protocol.md). Their flags and checks;
//! `main` runs them.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::{ConfigError, ProviderKind, bad};

#[derive(Debug, clap::Args)]
pub struct ProviderServeArgs {
    /// The in-tree provider: `sim`, `process` or `kubernetes`.
    #[arg(long, env = "VKD_PROVIDER")]
    pub provider: String,
    /// Its config file (`sim`: the fleet file).
    #[arg(long, env = "VKD_PROVIDER_CONFIG")]
    pub provider_config: Option<PathBuf>,
    /// Where it keeps its state.
    #[arg(long, env = "VKD_STATE_DIR")]
    pub state_dir: PathBuf,
    /// Where to listen: `unix:///path.sock` (made 0600, in a directory no
    /// one else can write) or `tls://host:port?cert=..&key=..&ca=..`
    /// (mutual TLS); plain TCP is refused.
    #[arg(long, env = "VKD_PROVIDER_ENDPOINT")]
    pub listen: String,
}

#[derive(Debug, clap::Args)]
pub struct ProviderConformanceArgs {
    /// The plugin: `unix:///path.sock[?peer-uid=N]` or
    /// `tls://host:port?cert=..&key=..&ca=..`; plain TCP is refused.
    #[arg(long, env = "VKD_PROVIDER_ENDPOINT")]
    pub endpoint: String,
    /// The node name the checks' Pods and fences carry.
    #[arg(long, default_value = "vkd-conformance")]
    pub node: String,
    /// How long one call may take (`10s`).
    #[arg(long, default_value = "10s")]
    pub timeout: String,
    /// How long a deletion may take to be confirmed (`30s`).
    #[arg(long, default_value = "30s")]
    pub patience: String,
}

impl ProviderServeArgs {
    /// The provider kind and the endpoint, checked.
    pub fn checked(&self) -> Result<(ProviderKind, vkd_grpc::Endpoint), ConfigError> {
        let kind = match self.provider.as_str() {
            "process" => ProviderKind::Process,
            "sim" => ProviderKind::Sim,
            "kubernetes" => ProviderKind::Kubernetes,
            other => {
                return Err(bad(
                    "provider",
                    format!("{other:?} is not an in-tree provider: process, sim, kubernetes"),
                ));
            }
        };
        let endpoint = self
            .listen
            .parse()
            .map_err(|e: vkd_grpc::GrpcError| bad("listen", e.to_string()))?;
        Ok((kind, endpoint))
    }
}

impl ProviderConformanceArgs {
    /// The endpoint, the call timeout and the patience, checked.
    pub fn checked(&self) -> Result<(vkd_grpc::Endpoint, Duration, Duration), ConfigError> {
        let endpoint = self
            .endpoint
            .parse()
            .map_err(|e: vkd_grpc::GrpcError| bad("endpoint", e.to_string()))?;
        let duration = |field: &'static str, text: &str| {
            vkd_provider::parse_duration(text)
                .filter(|d| !d.is_zero() && *d <= Duration::from_secs(3600))
                .ok_or_else(|| bad(field, format!("{text:?} is not a duration of at most 1h")))
        };
        Ok((
            endpoint,
            duration("timeout", &self.timeout)?,
            duration("patience", &self.patience)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    #[test]
    fn plain_tcp_is_refused_to_listen_on_and_to_dial() {
        for plain in ["tcp://127.0.0.1:7070", "http://127.0.0.1:7070"] {
            let serve = ProviderServeArgs {
                provider: "sim".into(),
                provider_config: None,
                state_dir: "/var/lib/vkd-sim".into(),
                listen: plain.into(),
            };
            let e = serve.checked().unwrap_err();
            assert_eq!(e.field, "listen");
            assert!(e.message.contains("plain TCP is refused"), "{}", e.message);
            let conformance = ProviderConformanceArgs {
                endpoint: plain.into(),
                node: "vkd-conformance".into(),
                timeout: "10s".into(),
                patience: "30s".into(),
            };
            let e = conformance.checked().unwrap_err();
            assert_eq!(e.field, "endpoint");
            assert!(e.message.contains("plain TCP is refused"), "{}", e.message);
        }
    }
}
