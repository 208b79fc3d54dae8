//! Authentication and authorization of kubelet API requests, as the kubelet does:
//! a client certificate from the client CA, or a bearer token checked with a
//! TokenReview; then a SubjectAccessReview on `nodes/<subresource>` of the Node asked.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::time::Instant;

const TOKEN_TTL: Duration = Duration::from_secs(120);
const ALLOW_TTL: Duration = Duration::from_secs(300);
const DENY_TTL: Duration = Duration::from_secs(30);
const CACHE_MAX: usize = 10_000;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct User {
    pub name: String,
    pub groups: Vec<String>,
    pub uid: Option<String>,
}

impl User {
    pub fn anonymous() -> Self {
        Self {
            name: "system:anonymous".into(),
            groups: vec!["system:unauthenticated".into()],
            uid: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No usable credentials (401).
    #[error("{0}")]
    Unauthorized(String),
    /// Authenticated, but not allowed (403).
    #[error("{0}")]
    Forbidden(String),
    /// A review could not be made (500 / 503).
    #[error("checking credentials with the API server: {0}")]
    Review(String),
}

/// The `nodes` subresource and verb a request is authorized as.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attributes {
    pub verb: &'static str,
    /// Tried first; `proxy` is the fallback for fine-grained ones.
    pub subresource: &'static str,
}

/// The kubelet's mapping: method to verb, path to subresource (KubeletFineGrainedAuthz
/// for /pods, /runningpods and /healthz, with `proxy` as the fallback).
pub fn attributes(method: &str, path: &str) -> Attributes {
    let verb = match method {
        "POST" => "create",
        "PUT" => "update",
        "PATCH" => "patch",
        "DELETE" => "delete",
        _ => "get",
    };
    let first = path
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or_default();
    let subresource = match first {
        "stats" => "stats",
        "metrics" => "metrics",
        "logs" => "log",
        "spec" => "spec",
        "checkpoint" => "checkpoint",
        "pods" | "runningpods" => "pods",
        "healthz" => "healthz",
        "configz" => "configz",
        _ => "proxy",
    };
    Attributes { verb, subresource }
}

/// What a SubjectAccessReview asks about: a `nodes` subresource of this node
/// (the kubelet's own checks), or a namespaced object (`vkd explain pod`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Target {
    verb: &'static str,
    resource: &'static str,
    subresource: Option<&'static str>,
    namespace: Option<String>,
    name: String,
}

impl Target {
    fn describe(&self) -> String {
        let what = match self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.to_owned(),
        };
        match &self.namespace {
            Some(ns) => format!(
                "{} resource \"{what}\" \"{}\" in namespace \"{ns}\"",
                self.verb, self.name
            ),
            None => format!(
                "{} resource \"{what}\" on node \"{}\"",
                self.verb, self.name
            ),
        }
    }
}

fn fine_grained(subresource: &str) -> bool {
    matches!(subresource, "pods" | "healthz" | "configz")
}

fn on_node(node: &str, verb: &'static str, sub: &'static str) -> Target {
    Target {
        verb,
        resource: "nodes",
        subresource: Some(sub),
        namespace: None,
        name: node.to_owned(),
    }
}

#[derive(Debug)]
struct Cache<K, V> {
    map: Mutex<HashMap<K, (Instant, V)>>,
}

impl<K: std::hash::Hash + Eq, V: Clone> Cache<K, V> {
    fn new() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
        }
    }

    fn get(&self, k: &K) -> Option<V> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(k)
            .filter(|(exp, _)| *exp > Instant::now())
            .map(|(_, v)| v.clone())
    }

    fn put(&self, k: K, v: V, ttl: Duration) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= CACHE_MAX {
            let now = Instant::now();
            map.retain(|_, (exp, _)| *exp > now);
            if map.len() >= CACHE_MAX {
                map.clear();
            }
        }
        map.insert(k, (Instant::now() + ttl, v));
    }
}

pub struct Authenticator {
    client: Client,
    anonymous: bool,
    /// Tokens are cached by a keyed hash, never stored.
    hasher: RandomState,
    tokens: Cache<u64, Result<User, String>>,
    decisions: Cache<(User, Target), Result<(), String>>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("anonymous", &self.anonymous)
            .finish()
    }
}

impl Authenticator {
    pub fn new(client: Client, anonymous: bool) -> Self {
        Self {
            client,
            anonymous,
            hasher: RandomState::new(),
            tokens: Cache::new(),
            decisions: Cache::new(),
        }
    }

    /// Who is asking: the certificate's user, else the token's, else anonymous if allowed.
    pub async fn authenticate(
        &self,
        cert_user: Option<User>,
        authorization: Option<&str>,
    ) -> Result<User, AuthError> {
        if let Some(u) = cert_user {
            return Ok(u);
        }
        let token = authorization
            .and_then(|h| {
                h.strip_prefix("Bearer ")
                    .or_else(|| h.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty());
        let Some(token) = token else {
            return if self.anonymous {
                Ok(User::anonymous())
            } else {
                Err(AuthError::Unauthorized(
                    "no client certificate or bearer token; anonymous requests are not allowed"
                        .into(),
                ))
            };
        };
        let key = self.hasher.hash_one(token);
        if let Some(cached) = self.tokens.get(&key) {
            return cached.map_err(AuthError::Unauthorized);
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let result = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Review(e.to_string()))?;
        let status = result.status.unwrap_or_default();
        let outcome = match (status.authenticated, status.user) {
            (Some(true), Some(u)) => Ok(User {
                name: u.username.unwrap_or_default(),
                groups: u.groups.unwrap_or_default(),
                uid: u.uid,
            }),
            _ => Err(format!(
                "the bearer token is not valid{}",
                status.error.map(|e| format!(": {e}")).unwrap_or_default()
            )),
        };
        self.tokens.put(key, outcome.clone(), TOKEN_TTL);
        outcome.map_err(AuthError::Unauthorized)
    }

    /// Asks the API server whether `user` may do `attrs` on Node `node`.
    pub async fn authorize(
        &self,
        user: &User,
        node: &str,
        attrs: &Attributes,
    ) -> Result<(), AuthError> {
        let first = self
            .review(user, on_node(node, attrs.verb, attrs.subresource))
            .await?;
        if first.is_ok() || !fine_grained(attrs.subresource) {
            return first.map_err(AuthError::Forbidden);
        }
        self.review(user, on_node(node, attrs.verb, "proxy"))
            .await?
            .map_err(AuthError::Forbidden)
    }

    /// Asks the API server whether `user` may `get` Pod `namespace/name`: what
    /// `vkd explain pod` needs, so that whoever may not read a Pod may not
    /// explain it either.
    pub async fn authorize_pod_read(
        &self,
        user: &User,
        namespace: &str,
        name: &str,
    ) -> Result<(), AuthError> {
        let target = Target {
            verb: "get",
            resource: "pods",
            subresource: None,
            namespace: Some(namespace.to_owned()),
            name: name.to_owned(),
        };
        self.review(user, target)
            .await?
            .map_err(AuthError::Forbidden)
    }

    async fn review(&self, user: &User, target: Target) -> Result<Result<(), String>, AuthError> {
        let key = (user.clone(), target);
        if let Some(d) = self.decisions.get(&key) {
            return Ok(d);
        }
        let target = &key.1;
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                groups: Some(user.groups.clone()),
                uid: user.uid.clone(),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(target.verb.into()),
                    resource: Some(target.resource.into()),
                    subresource: target.subresource.map(Into::into),
                    namespace: target.namespace.clone(),
                    name: Some(target.name.clone()),
                    version: Some("v1".into()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let result = api
            .create(&PostParams::default(), &sar)
            .await
            .map_err(|e| AuthError::Review(e.to_string()))?;
        let status = result.status.unwrap_or_default();
        let decision = if status.allowed {
            Ok(())
        } else {
            Err(format!(
                "User \"{}\" cannot {}{}",
                user.name,
                target.describe(),
                status.reason.map(|r| format!(": {r}")).unwrap_or_default()
            ))
        };
        self.decisions.put(
            key,
            decision.clone(),
            if decision.is_ok() {
                ALLOW_TTL
            } else {
                DENY_TTL
            },
        );
        Ok(decision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `vkd explain pod` is authorized as reading that Pod, not as the node:
    /// the review names pods, the namespace and the name, and is cached.
    #[tokio::test]
    async fn a_pod_read_is_reviewed_on_the_pod_and_cached() {
        let (client, log) = crate::testing::fake_api(|req| {
            let attrs = &req.body["spec"]["resourceAttributes"];
            let allowed = attrs["namespace"] == "team-a";
            (
                201,
                serde_json::json!({"apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview", "status": {"allowed": allowed}}),
            )
        });
        let auth = Authenticator::new(client, false);
        let user = User {
            name: "alice".into(),
            groups: vec!["team".into()],
            uid: None,
        };
        auth.authorize_pod_read(&user, "team-a", "p").await.unwrap();
        auth.authorize_pod_read(&user, "team-a", "p").await.unwrap();
        let refused = auth.authorize_pod_read(&user, "team-b", "p").await;
        match refused {
            Err(AuthError::Forbidden(m)) => assert_eq!(
                m,
                "User \"alice\" cannot get resource \"pods\" \"p\" in namespace \"team-b\""
            ),
            other => panic!("{other:?}"),
        }
        let reviews: Vec<serde_json::Value> = log
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.body["spec"]["resourceAttributes"].clone())
            .collect();
        assert_eq!(
            reviews.len(),
            2,
            "the allowed answer is cached: {reviews:?}"
        );
        assert_eq!(reviews[0]["resource"], "pods");
        assert_eq!(reviews[0]["name"], "p");
        assert!(reviews[0]["subresource"].is_null(), "{:?}", reviews[0]);
    }

    #[test]
    fn kubelet_mapping() {
        assert_eq!(
            attributes("GET", "/stats/summary"),
            Attributes {
                verb: "get",
                subresource: "stats"
            }
        );
        assert_eq!(
            attributes("GET", "/metrics/resource"),
            Attributes {
                verb: "get",
                subresource: "metrics"
            }
        );
        assert_eq!(
            attributes("POST", "/exec/ns/pod/c"),
            Attributes {
                verb: "create",
                subresource: "proxy"
            }
        );
        assert_eq!(
            attributes("GET", "/exec/ns/pod/c"),
            Attributes {
                verb: "get",
                subresource: "proxy"
            }
        );
        assert_eq!(
            attributes("GET", "/containerLogs/ns/p/c"),
            Attributes {
                verb: "get",
                subresource: "proxy"
            }
        );
        assert_eq!(
            attributes("GET", "/pods"),
            Attributes {
                verb: "get",
                subresource: "pods"
            }
        );
        assert_eq!(
            attributes("GET", "/healthz"),
            Attributes {
                verb: "get",
                subresource: "healthz"
            }
        );
        assert_eq!(
            attributes("GET", "/logs/x"),
            Attributes {
                verb: "get",
                subresource: "log"
            }
        );
        assert!(fine_grained("pods") && !fine_grained("proxy"));
    }
}
