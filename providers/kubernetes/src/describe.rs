//! The backend's own account of an instance (`vkd explain`): the downstream
//! Pod, where it runs, and what its cluster said about it.

use k8s_openapi::api::core::v1::Event;
use kube::Api;
use kube::api::ListParams;
use vkd_provider::Result;

use crate::KubernetesProvider;

impl KubernetesProvider {
    /// The downstream Pod of `uid` for a person: cluster, namespace and
    /// name, node, phase, and its own Events (the newest 10).
    pub(crate) async fn describe_downstream(&self, uid: &str) -> Result<Vec<(String, String)>> {
        let Some(pod) = self.find(uid).await? else {
            return Ok(Vec::new());
        };
        let d = self.synced().await?;
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let down_uid = pod.metadata.uid.clone().unwrap_or_default();
        let status = pod.status.clone().unwrap_or_default();
        let mut out = vec![
            ("downstream cluster".to_owned(), self.cluster.clone()),
            (
                "downstream Pod".to_owned(),
                format!("{ns}/{name} (uid {down_uid})"),
            ),
            (
                "downstream node".to_owned(),
                pod.spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_else(|| "(not scheduled)".into()),
            ),
            (
                "downstream phase".to_owned(),
                status.phase.unwrap_or_else(|| "(none)".into()),
            ),
        ];
        // The downstream Pod's own Events, the newest few: what its kubelet
        // and scheduler said.
        let events: Api<Event> = Api::namespaced(d.client.clone(), &ns);
        let listed = events
            .list(&ListParams::default().fields(&format!("involvedObject.uid={down_uid}")))
            .await;
        match listed {
            Ok(list) => {
                let mut items: Vec<_> = list
                    .items
                    .into_iter()
                    .map(|e| {
                        let at = e
                            .last_timestamp
                            .map(|t| t.0.to_string())
                            .or_else(|| e.event_time.map(|t| t.0.to_string()))
                            .unwrap_or_default();
                        let text = format!(
                            "{at} {} {}: {}",
                            e.type_.unwrap_or_default(),
                            e.reason.unwrap_or_default(),
                            e.message.unwrap_or_default()
                        );
                        (at, text)
                    })
                    .collect();
                items.sort();
                let skip = items.len().saturating_sub(10);
                for (_, text) in items.into_iter().skip(skip) {
                    out.push(("downstream event".to_owned(), text));
                }
            }
            Err(e) => out.push(("downstream events".to_owned(), format!("not readable: {e}"))),
        }
        Ok(out)
    }
}
