//! The `vkd explain` command, also run as `kubectl vkd explain` (a copy or a
//! link of the binary named `kubectl-vkd` on the PATH).
//!
//! It reads what the user may read from the API server (the Pod, its owners,
//! its Events, the Node) with the user's own kubeconfig, and asks the vkd
//! behind the node for its side through the API server's node proxy (or, with
//! `--direct` or `--kubelet`, directly, where vkd checks the user's own
//! credentials) ([`gather`]). Nothing is read with more privilege than the
//! user has. The daemon never imports this module: it serves its side as the
//! data in [`crate::explain`].

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;

pub mod dra;
mod error;
pub mod gather;
pub mod movement;
mod render;

pub use error::ExplainError;
use gather::{Explainer, Source};

/// `vkd explain`: why a Pod waits, why an instance exists, why nothing moved.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    #[command(subcommand)]
    pub what: Target,
    /// `text` for people, `json` for tools.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text, global = true)]
    pub output: Output,
    /// The kubeconfig to use (default: $KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Ask vkd's kubelet API directly, at the Node's InternalIP and kubelet
    /// port, with your own credentials, instead of through the API server's
    /// node proxy (which needs `nodes/proxy`, and which refuses loopback and
    /// link-local node addresses). vkd then authorizes you itself: `get` on
    /// the Pod for a Pod, `nodes/proxy` for a node or an instance.
    #[arg(long, global = true)]
    pub direct: bool,
    /// Like `--direct`, at this URL (`https://HOST:10250`): for a user who may
    /// not read the Node, or a vkd reached some other way.
    #[arg(long, global = true)]
    pub kubelet: Option<String>,
    /// CA bundle (PEM) that vkd's serving certificate chains to, when asked directly.
    #[arg(long, global = true)]
    pub kubelet_ca: Option<PathBuf>,
    /// When asked directly: do not check vkd's serving certificate (your
    /// credentials go to whoever answers).
    #[arg(long, global = true)]
    pub insecure_skip_tls_verify_kubelet: bool,
}

impl ExplainArgs {
    /// Where the answer is read from: what the gather step needs of the flags.
    fn source(&self) -> Source {
        Source {
            kubeconfig: self.kubeconfig.clone(),
            context: self.context.clone(),
            direct: self.direct,
            kubelet: self.kubelet.clone(),
            kubelet_ca: self.kubelet_ca.clone(),
            insecure_skip_tls_verify_kubelet: self.insecure_skip_tls_verify_kubelet,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Target {
    /// A Pod: its owners, binding, admission, instance, timeline, restarts,
    /// the decisions that name it, and why it did (not) move.
    Pod {
        /// `NAMESPACE/NAME`, or `NAME` with `--namespace`.
        pod: String,
        #[arg(short = 'n', long)]
        namespace: Option<String>,
    },
    /// A virtual node: what it advertises and why, reservations, waiting
    /// Pods, instances no Pod owns and what collection will do, the leader.
    Node { name: String },
    /// A backend instance: whose it is, or why it is an orphan or a
    /// duplicate, and what will happen to it.
    Instance {
        id: String,
        /// The virtual node whose backend holds it (default: ask every vkd node).
        #[arg(long)]
        node: Option<String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// Runs `vkd explain` and prints the answer.
pub async fn run(args: ExplainArgs) -> Result<(), ExplainError> {
    let pod = match &args.what {
        Target::Pod { pod, namespace } => Some(pod_name(pod, namespace.as_deref())?),
        Target::Node { name } => {
            checked("node", name, |b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
            })?;
            None
        }
        Target::Instance { id, node } => {
            // Backend ids go into the request's path: no query, fragment or escapes.
            checked("instance id", id, |b| {
                b.is_ascii_alphanumeric() || b"-._:/".contains(&b)
            })?;
            if id
                .split('/')
                .any(|part| part.is_empty() || part == "." || part == "..")
            {
                return Err(ExplainError::Usage(format!("{id:?} is not an instance id")));
            }
            if let Some(n) = node {
                checked("node", n, |b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
                })?;
            }
            None
        }
    };
    let out = Explainer::new(&args.source()).await?;
    let text = match &args.what {
        Target::Pod { .. } => {
            let (ns, name) = pod.unwrap_or_default();
            let e = out.pod(&ns, &name).await?;
            emit(args.output, &e, render::pod)
        }
        Target::Node { name } => {
            let e = out.node(name).await?;
            emit(args.output, &e, render::node)
        }
        Target::Instance { id, node } => {
            let e = out.instance(id, node.as_deref()).await?;
            emit(args.output, &e, render::instance)
        }
    };
    print!("{text}");
    Ok(())
}

/// `what` is 1 to 253 bytes, each one `allowed`.
fn checked(what: &str, value: &str, allowed: impl Fn(u8) -> bool) -> Result<(), ExplainError> {
    if value.is_empty() || value.len() > 253 || !value.bytes().all(allowed) {
        return Err(ExplainError::Usage(format!(
            "{value:?} is not a valid {what}"
        )));
    }
    Ok(())
}

/// `NAMESPACE/NAME`, or `NAME` with `--namespace` (default `default`).
fn pod_name(pod: &str, namespace: Option<&str>) -> Result<(String, String), ExplainError> {
    let (ns, name) = match (pod.split_once('/'), namespace) {
        (Some(_), Some(_)) => {
            return Err(ExplainError::Usage(
                "give the Pod as NAMESPACE/NAME or as NAME with --namespace, not both".into(),
            ));
        }
        (Some((ns, name)), None) => (ns, name),
        (None, ns) => (ns.unwrap_or("default"), pod),
    };
    let valid = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    if !valid(ns) || !valid(name) {
        return Err(ExplainError::Usage(format!(
            "{pod:?} is not a Pod name: NAMESPACE/NAME, lowercase letters, digits, '-' and '.'"
        )));
    }
    Ok((ns.to_owned(), name.to_owned()))
}

fn emit<T: Serialize>(output: Output, value: &T, text: fn(&T) -> String) -> String {
    match output {
        Output::Json => serde_json::to_string_pretty(value)
            .map(|s| s + "\n")
            .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}\n")),
        Output::Text => text(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_names_are_checked_before_anything_is_asked() {
        assert_eq!(pod_name("ns/p", None).unwrap(), ("ns".into(), "p".into()));
        assert_eq!(
            pod_name("p", Some("ns")).unwrap(),
            ("ns".into(), "p".into())
        );
        assert_eq!(pod_name("p", None).unwrap(), ("default".into(), "p".into()));
        for bad in ["a/b/c", "ns/", "/p", "NS/p", "ns/p?x=1"] {
            assert!(
                matches!(pod_name(bad, None), Err(ExplainError::Usage(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            pod_name("a/b", Some("x")),
            Err(ExplainError::Usage(_))
        ));
    }
}
