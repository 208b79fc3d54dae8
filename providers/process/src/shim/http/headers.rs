//! The action's headers, as Go's `http.Header` holds them and its client
//! checks and writes them.

use std::collections::BTreeMap;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http_body_util::Empty;

use super::target::{Target, host_header_byte, is_ctl};

/// The action's headers, as Go's `http.Header` holds them: canonical names,
/// checked as Go's client checks them before it sends anything.
#[derive(Debug)]
pub(super) struct Headers {
    /// Every header but `Host`, by canonical name (Go writes them sorted).
    pub(super) fields: BTreeMap<String, Vec<HeaderValue>>,
    /// The action's `Host`, when it names a non-empty one; empty where Go
    /// finds it no valid host (it then sends an empty one).
    pub(super) host: Option<String>,
}

impl Headers {
    pub(super) fn of(given: &[(String, String)], user_agent: &str) -> Result<Self, String> {
        let mut by_name: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for (name, value) in given {
            if name.is_empty() || !name.bytes().all(token_byte) {
                return Err(format!("net/http: invalid header field name {name:?}"));
            }
            let name = canonical(name);
            if value.bytes().any(|b| is_ctl(b) && b != b'\t') {
                return Err(format!("net/http: invalid header field value for {name:?}"));
            }
            by_name.entry(name).or_default().push(value);
        }
        let host = by_name
            .remove("Host")
            .and_then(|v| v.first().map(|h| (*h).to_owned()))
            .filter(|h| !h.is_empty())
            .map(|h| {
                if h.bytes().all(host_header_byte) {
                    h
                } else {
                    String::new()
                }
            });
        // The kubelet's `newProbeRequest`: its user agent and `Accept: */*`
        // unless named; an empty `Accept` is none at all.
        if !by_name.contains_key("User-Agent") {
            by_name.insert("User-Agent".into(), vec![user_agent]);
        }
        match by_name.get("Accept") {
            None => {
                by_name.insert("Accept".into(), vec!["*/*"]);
            }
            Some(v) if v.first().is_some_and(|a| a.is_empty()) => {
                by_name.remove("Accept");
            }
            Some(_) => {}
        }
        let mut fields = BTreeMap::new();
        for (name, values) in by_name {
            // Go writes these itself, or never from the header map.
            if matches!(
                name.as_str(),
                "Content-Length" | "Transfer-Encoding" | "Trailer"
            ) {
                continue;
            }
            let values = values
                .into_iter()
                .map(|v| HeaderValue::from_bytes(v.as_bytes()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| format!("net/http: invalid header field value for {name:?}"))?;
            fields.insert(name, values);
        }
        Ok(Self { fields, host })
    }

    /// The request to `at` with `host` as its `Host`, as Go's client writes
    /// it: `Host`, `User-Agent` (its first value, none when empty), the rest
    /// sorted by name, `Connection: close`.
    pub(super) fn request(
        &self,
        at: &Target,
        host: &str,
        referer: Option<String>,
    ) -> Result<http::Request<Empty<Bytes>>, String> {
        let mut map = HeaderMap::new();
        let header = |n: &str| HeaderName::from_bytes(n.as_bytes()).map_err(|e| e.to_string());
        map.insert(
            http::header::HOST,
            HeaderValue::from_bytes(host.as_bytes()).map_err(|e| e.to_string())?,
        );
        if let Some(ua) = self
            .fields
            .get("User-Agent")
            .and_then(|v| v.first())
            .filter(|v| !v.is_empty())
        {
            map.insert(http::header::USER_AGENT, ua.clone());
        }
        let mut fields = self.fields.clone();
        if let Some(r) = referer.filter(|_| !fields.contains_key("Referer")) {
            let r = HeaderValue::from_bytes(r.as_bytes()).map_err(|e| e.to_string())?;
            fields.insert("Referer".into(), vec![r]);
        }
        let mut closes = false;
        for (name, values) in &fields {
            if name == "User-Agent" {
                continue;
            }
            let name = header(name)?;
            for v in values {
                if name == http::header::CONNECTION {
                    closes |= v.to_str().is_ok_and(|v| {
                        v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close"))
                    });
                }
                map.append(name.clone(), v.clone());
            }
        }
        if !closes {
            map.append(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        let uri: http::Uri = at
            .target
            .parse()
            .map_err(|e: http::uri::InvalidUri| e.to_string())?;
        let mut request = http::Request::new(Empty::new());
        *request.uri_mut() = uri;
        *request.headers_mut() = map;
        Ok(request)
    }
}

/// A byte of an HTTP token: what a header's name is made of.
pub(super) fn token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Go's canonical form of a valid header name: `x-custom-id` is `X-Custom-Id`.
pub(super) fn canonical(name: &str) -> String {
    let mut upper = true;
    name.chars()
        .map(|c| {
            let c = if upper {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            };
            upper = c == '-';
            c
        })
        .collect()
}
