//! A [`Provider`] that is a plugin at the other end of the protocol: what
//! `vkd run --provider grpc --provider-endpoint ...` runs.
//!
//! Every call has a deadline. A plugin that is gone, slow or speaking another
//! version makes calls fail as transient (never as a fence: only the plugin's
//! own FENCED answer is one) and health say `ProviderPluginUnreachable` with
//! why, so the Node goes not Ready with the reason while nothing is fenced or
//! lost. When the plugin answers again it is asked its version again, and the
//! event stream starts with a resync, so vkd lists every instance and adopts
//! what the plugin kept.

mod history;
mod streams;

use streams::feed;

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::io::AsyncWriteExt;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::{BroadcastStream, ReceiverStream};
use tonic::transport::Channel;
use vkd_provider::{
    Admission, Capabilities, Capacity, ContainerSpec, Fence, Health, Instance, InstanceEvent,
    InstanceSpec, LogRequest, Logs, PodStats, Provider, ProviderError, Result, StreamIo, Volume,
};

use crate::convert::{self, error_of};
use crate::pb::provider_client::ProviderClient;
use crate::{Endpoint, GrpcError, MAX_MESSAGE, VERSION, pb};

/// The reason health gives while the plugin does not answer.
pub const UNREACHABLE: &str = "ProviderPluginUnreachable";
/// How long the event stream waits before asking a silent plugin again.
const RECONNECT: Duration = Duration::from_secs(1);

/// What the plugin said of itself at the last Hello.
#[derive(Clone, Debug, Default)]
struct Said {
    name: String,
    capabilities: Capabilities,
    identity: Vec<(String, String)>,
}

pub struct GrpcProvider {
    endpoint: Endpoint,
    client: ProviderClient<Channel>,
    /// Each call's deadline (streams: their setup).
    timeout: Duration,
    said: Mutex<Said>,
    /// The name, fixed at the first Hello (the trait hands out `&str`).
    name: String,
    /// Whether the last health check found the plugin gone: the next answer
    /// is checked with a Hello first.
    lost: Mutex<bool>,
    /// The plugin's notices, from the one Events call kept open.
    events: broadcast::Sender<InstanceEvent>,
    /// Ends that call when the provider goes.
    _events_task: tokio_util::sync::DropGuard,
}

impl std::fmt::Debug for GrpcProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcProvider")
            .field("endpoint", &self.endpoint.to_string())
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn bad_answer(what: String) -> ProviderError {
    ProviderError::transient(format!("provider plugin: {what}"))
}

impl GrpcProvider {
    /// Connects to the plugin at `endpoint` and asks its version; `timeout`
    /// bounds every call. Fails, naming the endpoint, when nothing answers
    /// there, it speaks another version, or (`unix://`) the process
    /// listening is not root, vkd's user or the endpoint's `peer-uid`.
    pub async fn connect(endpoint: Endpoint, timeout: Duration) -> Result<Self, GrpcError> {
        // A plugin run by an unexpected user is refused saying so, not as
        // one that does not answer (the channel's connector checks too, on
        // every reconnect).
        if let Some(refused) = peer_refused(&endpoint).await {
            return Err(refused.into());
        }
        let channel = endpoint.channel(timeout)?;
        let client = ProviderClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let failed = |why| GrpcError::Hello {
            endpoint: endpoint.to_string(),
            why,
        };
        let said = hello(&client, timeout).await.map_err(failed)?;
        // Subscribed before anything is asked: no change after this is missed.
        let first = subscribe(&client, timeout).await.map_err(failed)?;
        let (events, _) = broadcast::channel(4096);
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(pump_events(
            client.clone(),
            first,
            events.clone(),
            timeout,
            stop.clone(),
        ));
        Ok(Self {
            name: said.name.clone(),
            endpoint,
            client,
            timeout,
            said: Mutex::new(said),
            lost: Mutex::default(),
            events,
            _events_task: stop.drop_guard(),
        })
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        self.request_within(message, Duration::ZERO)
    }

    /// A request whose deadline is the call's plus `more` (a deletion's grace).
    fn request_within<T>(&self, message: T, more: Duration) -> tonic::Request<T> {
        let mut r = tonic::Request::new(message);
        r.set_timeout(self.timeout.saturating_add(more));
        r
    }

    fn client(&self) -> ProviderClient<Channel> {
        self.client.clone()
    }
}

/// The refusal, when the process that listens at a `unix://` endpoint now
/// runs as a user vkd does not speak to: said as such, not as a plugin that
/// does not answer.
async fn peer_refused(endpoint: &Endpoint) -> Option<crate::SocketError> {
    let Endpoint::Unix { path, peer_uid } = endpoint else {
        return None;
    };
    match crate::socket::dial(path, *peer_uid, &endpoint.to_string()).await {
        Err(e @ crate::SocketError::UnexpectedPeer { .. }) => Some(e),
        _ => None,
    }
}

/// Opens the Events call; its answer's headers mean the plugin has subscribed.
async fn subscribe(
    client: &ProviderClient<Channel>,
    timeout: Duration,
) -> Result<tonic::Streaming<pb::Event>, String> {
    tokio::time::timeout(timeout, client.clone().events(pb::Empty {}))
        .await
        .map_err(|_| format!("no answer to Events within {timeout:?}"))?
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("Events: {:?}: {}", s.code(), s.message()))
}

/// Passes the plugin's notices on while the Events call lasts; when it ends,
/// calls again until the plugin answers, and then says resync: what changed
/// meanwhile is unknown.
async fn pump_events(
    client: ProviderClient<Channel>,
    mut stream: tonic::Streaming<pb::Event>,
    to: broadcast::Sender<InstanceEvent>,
    timeout: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        loop {
            let next = tokio::select! {
                () = stop.cancelled() => return,
                next = stream.next() => next,
            };
            match next {
                Some(Ok(event)) => {
                    // No receiver yet is not an error: nobody asked.
                    let _ = to.send(convert::event_of(event));
                }
                _ => break,
            }
        }
        stream = loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(RECONNECT) => {}
            }
            if let Ok(s) = subscribe(&client, timeout).await {
                break s;
            }
        };
        let _ = to.send(InstanceEvent::Resync);
    }
}

/// Asks the plugin its version and what it is.
async fn hello(client: &ProviderClient<Channel>, timeout: Duration) -> Result<Said, String> {
    let mut request = tonic::Request::new(pb::HelloRequest {
        versions: vec![VERSION],
    });
    request.set_timeout(timeout);
    // The whole answer within the deadline: a plugin that sends its headers
    // and then stalls must not hold vkd's start.
    let reply = tokio::time::timeout(timeout, client.clone().hello(request))
        .await
        .map_err(|_| format!("no answer to Hello within {timeout:?}"))?
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    if reply.version != VERSION {
        return Err(format!(
            "the plugin answered with protocol version {}; vkd speaks {VERSION}",
            reply.version
        ));
    }
    if reply.name.is_empty() {
        return Err("the plugin gave no name".into());
    }
    Ok(Said {
        name: reply.name,
        capabilities: convert::capabilities_of(&reply.capabilities),
        identity: reply.identity.into_iter().collect(),
    })
}

#[async_trait]
impl Provider for GrpcProvider {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        lock(&self.said).capabilities
    }

    fn identity(&self) -> Vec<(String, String)> {
        lock(&self.said).identity.clone()
    }

    async fn health(&self) -> Health {
        // Unreachable, in the words of the refusal when the socket's
        // listener is now a user vkd does not speak to.
        let unreachable = async |message: String| Health::Unhealthy {
            reason: UNREACHABLE.into(),
            message: match peer_refused(&self.endpoint).await {
                Some(refused) => refused.to_string(),
                None => format!("the provider plugin at {}: {message}", self.endpoint),
            },
        };
        if *lock(&self.lost) {
            match hello(&self.client, self.timeout).await {
                Ok(said) => *lock(&self.said) = said,
                Err(why) => return unreachable(why).await,
            }
        }
        match self.client().health(self.request(pb::Empty {})).await {
            Ok(reply) => {
                *lock(&self.lost) = false;
                convert::health_of(reply.into_inner())
            }
            Err(s) => {
                *lock(&self.lost) = true;
                unreachable(format!("{:?}: {}", s.code(), s.message())).await
            }
        }
    }

    async fn capacity(&self) -> Result<Capacity> {
        let doc = self
            .client()
            .capacity(self.request(pb::Empty {}))
            .await
            .map_err(|s| error_of(&s))?
            .into_inner();
        convert::read_document(Some(&doc), "Capacity").map_err(bad_answer)
    }

    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission> {
        let reply = self
            .client()
            .admit(self.request(convert::document(spec)?))
            .await
            .map_err(|s| error_of(&s))?
            .into_inner();
        convert::admission_of(reply)
    }

    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        let request = pb::CreateRequest {
            fence: Some(convert::fence_msg(fence)),
            spec: Some(convert::document(spec)?),
        };
        let doc = self
            .client()
            .create(self.request(request))
            .await
            .map_err(|s| error_of(&s))?
            .into_inner();
        let instance: Instance =
            convert::read_document(Some(&doc), "Instance").map_err(bad_answer)?;
        if instance.owner.uid != spec.pod.uid {
            return Err(bad_answer(format!(
                "create of Pod {} answered with the instance of Pod {}",
                spec.pod.uid, instance.owner.uid
            )));
        }
        Ok(instance)
    }

    async fn get(&self, uid: &str) -> Result<Option<Instance>> {
        let reply = self
            .client()
            .get(self.request(pb::UidRequest { uid: uid.into() }))
            .await
            .map_err(|s| error_of(&s))?
            .into_inner();
        let Some(doc) = reply.instance else {
            return Ok(None);
        };
        let instance: Instance =
            convert::read_document(Some(&doc), "Instance").map_err(bad_answer)?;
        if instance.owner.uid != uid {
            return Err(bad_answer(format!(
                "get of Pod {uid} answered with the instance of Pod {}",
                instance.owner.uid
            )));
        }
        Ok(Some(instance))
    }

    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        let request = pb::DeleteRequest {
            fence: Some(convert::fence_msg(fence)),
            uid: uid.into(),
            grace_millis: convert::millis(grace),
        };
        self.client()
            .delete(self.request_within(request, grace))
            .await
            .map_err(|s| error_of(&s))?;
        Ok(())
    }

    async fn takeover(&self, fence: &Fence) -> Result<()> {
        self.client()
            .takeover(self.request(convert::fence_msg(fence)))
            .await
            .map_err(|s| error_of(&s))?;
        Ok(())
    }

    async fn delete_instance(&self, fence: &Fence, id: &str, grace: Duration) -> Result<()> {
        let request = pb::DeleteInstanceRequest {
            fence: Some(convert::fence_msg(fence)),
            id: id.into(),
            grace_millis: convert::millis(grace),
        };
        self.client()
            .delete_instance(self.request_within(request, grace))
            .await
            .map_err(|s| error_of(&s))?;
        Ok(())
    }

    async fn list(&self, node: &str) -> Result<Vec<Instance>> {
        let doc = self
            .client()
            .list(self.request(pb::ListRequest { node: node.into() }))
            .await
            .map_err(|s| error_of(&s))?
            .into_inner();
        convert::read_document(Some(&doc), "Instance list").map_err(bad_answer)
    }

    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        // From the one call kept open; a receiver that fell behind resyncs.
        BroadcastStream::new(self.events.subscribe())
            .map(|e| e.unwrap_or(InstanceEvent::Resync))
            .boxed()
    }

    async fn logs(&self, uid: &str, container: &str, request: LogRequest) -> Result<Logs> {
        let r = pb::LogsRequest {
            uid: uid.into(),
            container: container.into(),
            previous: request.previous,
            follow: request.follow,
            tail_lines: request.tail_lines,
            since_unix_nanos: request.since.map(convert::unix_nanos),
            limit_bytes: request.limit_bytes,
        };
        // A followed log lasts as long as the container: only its setup has
        // the deadline.
        let mut stream = tokio::time::timeout(self.timeout, self.client().logs(r))
            .await
            .map_err(|_| ProviderError::transient("provider plugin: no log within the deadline"))?
            .map_err(|s| error_of(&s))?
            .into_inner();
        let mut history = history::History::new(&request);
        loop {
            match stream.message().await.map_err(|s| error_of(&s))? {
                Some(pb::LogChunk {
                    item: Some(pb::log_chunk::Item::Line(l)),
                }) => history
                    .push(convert::log_line_of(l))
                    .map_err(|why| ProviderError::invalid("LogTooLarge", why))?,
                Some(pb::LogChunk {
                    item: Some(pb::log_chunk::Item::HistoryEnd(_)),
                }) => break,
                Some(_) => {
                    return Err(bad_answer(
                        "a log message that is neither line nor end".into(),
                    ));
                }
                None => return Err(bad_answer("the log ended before its history did".into())),
            }
        }
        let follow = request.follow.then(|| {
            stream
                .take_while(|m| futures::future::ready(m.is_ok()))
                .filter_map(|m| {
                    futures::future::ready(match m {
                        Ok(pb::LogChunk {
                            item: Some(pb::log_chunk::Item::Line(l)),
                        }) => Some(convert::log_line_of(l)),
                        _ => None,
                    })
                })
                .boxed()
        });
        Ok(Logs {
            history: history.into_lines(),
            follow,
        })
    }

    async fn exec(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: StreamIo,
    ) -> Result<i32> {
        self.session(uid, container, command, io, true).await
    }

    async fn attach(&self, uid: &str, container: &str, io: StreamIo) -> Result<()> {
        self.session(uid, container, Vec::new(), io, false)
            .await
            .map(|_| ())
    }

    async fn port_forward(
        &self,
        uid: &str,
        port: u16,
        stream: Box<dyn vkd_provider::Duplex>,
    ) -> Result<()> {
        let (tx, rx) = mpsc::channel(16);
        let start = pb::ForwardIn {
            msg: Some(pb::forward_in::Msg::Start(pb::ForwardStart {
                uid: uid.into(),
                port: port.into(),
            })),
        };
        tx.send(start)
            .await
            .map_err(|_| ProviderError::transient("provider plugin: port-forward closed"))?;
        let mut answers = tokio::time::timeout(
            self.timeout,
            self.client().port_forward(ReceiverStream::new(rx)),
        )
        .await
        .map_err(|_| {
            ProviderError::transient("provider plugin: no port-forward within the deadline")
        })?
        .map_err(|s| error_of(&s))?
        .into_inner();
        let (from_client, mut to_client) = tokio::io::split(stream);
        let sending = feed(
            from_client,
            tx,
            |data| pb::ForwardIn {
                msg: Some(pb::forward_in::Msg::Data(data)),
            },
            pb::ForwardIn {
                msg: Some(pb::forward_in::Msg::End(true)),
            },
        );
        let result = loop {
            match answers.message().await {
                Ok(Some(out)) => {
                    if to_client.write_all(&out.data).await.is_err() {
                        break Ok(());
                    }
                }
                Ok(None) => break Ok(()),
                Err(s) => break Err(error_of(&s)),
            }
        };
        let _ = to_client.shutdown().await;
        sending.abort();
        result
    }

    async fn start_ephemeral(
        &self,
        fence: &Fence,
        uid: &str,
        container: &ContainerSpec,
    ) -> Result<()> {
        let request = pb::StartEphemeralRequest {
            fence: Some(convert::fence_msg(fence)),
            uid: uid.into(),
            container: Some(convert::document(container)?),
        };
        self.client()
            .start_ephemeral(self.request(request))
            .await
            .map_err(|s| error_of(&s))?;
        Ok(())
    }

    async fn update_volumes(&self, fence: &Fence, uid: &str, volumes: &[Volume]) -> Result<()> {
        let request = pb::UpdateVolumesRequest {
            fence: Some(convert::fence_msg(fence)),
            uid: uid.into(),
            volumes: Some(convert::document(&volumes)?),
        };
        self.client()
            .update_volumes(self.request(request))
            .await
            .map_err(|s| error_of(&s))?;
        Ok(())
    }

    async fn stats(&self, uid: &str) -> Result<PodStats> {
        let doc = self
            .client()
            .stats(self.request(pb::UidRequest { uid: uid.into() }))
            .await
            .map_err(|s| error_of(&s))?
            .into_inner();
        let stats: PodStats = convert::read_document(Some(&doc), "PodStats").map_err(bad_answer)?;
        // Another Pod's figures would be held against this Pod's limits.
        if stats.pod.uid != uid {
            return Err(bad_answer(format!(
                "stats of Pod {uid} answered with those of Pod {}",
                stats.pod.uid
            )));
        }
        Ok(stats)
    }

    async fn describe(&self, uid: &str) -> Result<Vec<(String, String)>> {
        let reply = self
            .client()
            .describe(self.request(pb::UidRequest { uid: uid.into() }))
            .await
            .map_err(|s| error_of(&s))?
            .into_inner();
        Ok(reply.pairs.into_iter().map(|p| (p.what, p.value)).collect())
    }
}
