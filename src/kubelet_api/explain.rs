//! vkd's own routes on the kubelet API: `/explain/...`, what `vkd explain`
//! asks (docs/explain.md).

use hyper::{Response, StatusCode};

use super::{Body, NodeApi, json_response, provider_error, status};

/// For `/explain/pod/{ns}/{name}`, the Pod whose read authorizes the request
/// (`None` for any other path); a malformed explain path is a 404 at once.
pub(super) fn pod_read(path: &str) -> Result<Option<(String, String)>, Response<Body>> {
    let Some(rest) = path.strip_prefix("/explain/pod/") else {
        return Ok(None);
    };
    let mut parts = rest.split('/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(ns), Some(name), None) if !ns.is_empty() && !name.is_empty() => {
            Ok(Some((ns.to_owned(), name.to_owned())))
        }
        _ => Err(status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "explain a Pod as /explain/pod/NAMESPACE/NAME",
        )),
    }
}

/// An answer as JSON; one that cannot be encoded is a 500, never a panic.
fn json_of(answer: &impl serde::Serialize) -> Response<Body> {
    match serde_json::to_value(answer) {
        Ok(v) => json_response(&v),
        Err(e) => status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            &format!("encoding the answer: {e}"),
        ),
    }
}

impl NodeApi {
    /// `GET /explain/{what..}`, once authorized.
    pub(super) async fn explain(&self, what: &[&str]) -> Response<Body> {
        match what {
            ["pod", ns, name] => match self.pods.explain_pod(ns, name).await {
                Some(answer) => json_of(&answer),
                None => status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!(
                        "pod \"{name}\" in namespace \"{ns}\" is not bound to node {}",
                        self.pods.node()
                    ),
                ),
            },
            ["node"] => json_of(&self.pods.explain_node().await),
            // Backend ids may hold '/' (the kubernetes provider's do).
            ["instance", id @ ..] if !id.is_empty() => {
                match self.pods.explain_instance(&id.join("/")).await {
                    Ok(answer) => json_of(&answer),
                    Err(e) => provider_error(&e),
                }
            }
            _ => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "explain routes: /explain/pod/NAMESPACE/NAME, /explain/node, /explain/instance/ID",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_whole_pod_path_is_a_pod_read() {
        assert_eq!(
            pod_read("/explain/pod/ns/p").ok().flatten(),
            Some(("ns".into(), "p".into()))
        );
        assert!(matches!(pod_read("/explain/node"), Ok(None)));
        assert!(matches!(pod_read("/pods"), Ok(None)));
        for bad in [
            "/explain/pod/ns",
            "/explain/pod/ns/",
            "/explain/pod//p",
            "/explain/pod/ns/p/x",
        ] {
            assert!(pod_read(bad).is_err(), "{bad}");
        }
    }
}
