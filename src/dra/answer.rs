//! vkd's answer before binding, written where the scheduler reads it: the
//! binding conditions on each of a Pod's devices of this driver (server-side
//! apply, field manager `vkd-binding`), an Event when the Pod waits or is
//! refused, and the count by answer.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use serde_json::json;
use tracing::warn;

use super::DraError;
use super::devices;

const FIELD_MANAGER: &str = "vkd-binding";

pub(super) struct Answers {
    client: Client,
    recorder: Recorder,
    metrics: Arc<crate::metrics::Metrics>,
    driver: String,
}

impl Answers {
    /// `instance` names the reporter of the Events (the first Node).
    pub(super) fn new(
        client: Client,
        instance: Option<String>,
        metrics: Arc<crate::metrics::Metrics>,
        driver: String,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "vkd".into(),
                instance,
            },
        );
        Self {
            client,
            recorder,
            metrics,
            driver,
        }
    }

    /// Writes the two conditions on each of the Pod's devices of this driver.
    pub(super) async fn say(
        &self,
        claims: &[ResourceClaim],
        pod: &Pod,
        reserved: bool,
        rejected: Option<(&str, &str)>,
        reserved_why: Option<(&str, &str)>,
    ) -> Result<(), DraError> {
        let answer = match (reserved, rejected) {
            (_, Some(_)) => "rejected",
            (true, None) => "reserved",
            (false, None) => "queued",
        };
        if let Some(r) = claims
            .iter()
            .flat_map(devices::allocated)
            .find(|r| r.driver == self.driver)
        {
            self.metrics.dra_admission(&r.pool, answer);
        }
        let now = crate::pods::status::time(std::time::SystemTime::now());
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let conditions =
            devices::binding_conditions(reserved, rejected, reserved_why, &pod_name, &now);
        // The happy path's answer is the claim's condition alone: an Event per
        // Pod would be one more write per Pod in a storm. Waiting and refusals
        // get one, as the create step's queueing and failures do.
        let event = match (rejected, reserved) {
            (Some((reason, message)), _) => Some((
                EventType::Warning,
                "BackendRejected",
                format!("{reason}: {message}; the scheduler places it again"),
            )),
            (None, false) => reserved_why
                .map(|(reason, message)| (EventType::Normal, reason, message.to_owned())),
            (None, true) => None,
        };
        if let Some((type_, reason, note)) = event {
            let reference = k8s_openapi::api::core::v1::ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: pod.metadata.name.clone(),
                namespace: pod.metadata.namespace.clone(),
                uid: pod.metadata.uid.clone(),
                ..Default::default()
            };
            let event = Event {
                type_,
                reason: reason.to_owned(),
                note: Some(
                    format!("before binding: {note}")
                        .chars()
                        .take(1000)
                        .collect(),
                ),
                action: "Admit".into(),
                secondary: None,
            };
            if let Err(e) = self.recorder.publish(&event, &reference).await {
                warn!(error = %e, reason, "publishing event failed");
            }
        }
        for c in claims {
            let (Some(name), Some(ns)) = (&c.metadata.name, &c.metadata.namespace) else {
                continue;
            };
            let devices: Vec<serde_json::Value> = devices::allocated(c)
                .iter()
                .filter(|r| r.driver == self.driver)
                .map(|r| {
                    json!({"driver": r.driver, "pool": r.pool, "device": r.device,
                           "conditions": conditions})
                })
                .collect();
            if devices.is_empty() {
                continue;
            }
            let body = devices::device_status(name, ns, devices);
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), ns);
            api.patch_status(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(body),
            )
            .await
            .map_err(|source| DraError::Api {
                what: format!("writing the binding conditions of ResourceClaim {ns}/{name}"),
                source,
            })?;
        }
        Ok(())
    }
}
