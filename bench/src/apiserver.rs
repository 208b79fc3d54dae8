//! What the API server says about itself: its request counters and sizes
//! (`/metrics`) and its CPU profile (`/debug/pprof/profile`).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Result, bail};
use kube::Client;
use vkd_e2e::repo_root;

/// What the API server's `/metrics` said at one moment: requests by
/// "VERB resource/subresource", request body bytes by the same key, and the
/// bytes of watch events it sent, by kind.
#[derive(Debug, Default)]
pub(crate) struct ApiScrape {
    pub(crate) requests: HashMap<String, f64>,
    pub(crate) body_bytes: HashMap<String, f64>,
    pub(crate) watch_bytes: f64,
}

impl ApiScrape {
    pub(crate) async fn read(client: &Client) -> Result<Self> {
        let req = http::Request::get("/metrics").body(Vec::new())?;
        let text = client.request_text(req).await?;
        Self::parse(&text)
    }

    fn parse(text: &str) -> Result<Self> {
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))?;
        let mut out = Self::default();
        for s in scrape.samples {
            let value = match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => continue,
            };
            let key = || {
                format!(
                    "{} {}/{}",
                    s.labels.get("verb").unwrap_or(""),
                    s.labels.get("resource").unwrap_or(""),
                    s.labels.get("subresource").unwrap_or("")
                )
            };
            match s.metric.as_str() {
                "apiserver_request_total" => *out.requests.entry(key()).or_default() += value,
                "apiserver_request_body_size_bytes_sum" => {
                    *out.body_bytes.entry(key()).or_default() += value;
                }
                "apiserver_watch_events_sizes_sum" => out.watch_bytes += value,
                _ => {}
            }
        }
        Ok(out)
    }
}

/// Takes a CPU profile of the API server (`/debug/pprof/profile`) and saves it
/// as `target/bench/<file>`, where it outlives the cluster.
pub(crate) async fn apiserver_profile(
    client: Client,
    seconds: u32,
    file: String,
) -> Result<PathBuf> {
    use http_body_util::BodyExt;
    let req = http::Request::get(format!("/debug/pprof/profile?seconds={seconds}"))
        .body(kube::client::Body::empty())?;
    let res = client.send(req).await?;
    if !res.status().is_success() {
        bail!("the apiserver answered {}", res.status());
    }
    let bytes = res.into_body().collect().await?.to_bytes();
    let dir = repo_root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(file);
    std::fs::write(&path, &bytes)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_servers_counters_are_read_by_verb_and_resource() {
        let text = "\
# TYPE apiserver_request_total counter
apiserver_request_total{code=\"201\",resource=\"pods\",subresource=\"\",verb=\"POST\"} 3
apiserver_request_total{code=\"200\",resource=\"pods\",subresource=\"status\",verb=\"PATCH\"} 2
apiserver_request_total{code=\"409\",resource=\"pods\",subresource=\"status\",verb=\"PATCH\"} 1
# TYPE apiserver_request_body_size_bytes histogram
apiserver_request_body_size_bytes_bucket{resource=\"pods\",verb=\"patch\",le=\"+Inf\"} 3
apiserver_request_body_size_bytes_sum{resource=\"pods\",verb=\"patch\"} 1200
apiserver_request_body_size_bytes_count{resource=\"pods\",verb=\"patch\"} 3
# TYPE apiserver_watch_events_sizes histogram
apiserver_watch_events_sizes_sum{group=\"\",kind=\"Pod\",version=\"v1\"} 5000
apiserver_watch_events_sizes_sum{group=\"\",kind=\"Event\",version=\"v1\"} 700
";
        let s = ApiScrape::parse(text).unwrap();
        assert_eq!(s.requests["POST pods/"], 3.0);
        assert_eq!(s.requests["PATCH pods/status"], 3.0, "codes summed");
        assert_eq!(s.body_bytes["patch pods/"], 1200.0);
        assert_eq!(s.watch_bytes, 5700.0);
    }
}
