//! Any [`Provider`] served over the protocol: what a plugin written in Rust
//! runs, and how `vkd provider-serve` puts an in-tree provider (the sim, say)
//! behind the wire for the conformance program and for measuring the
//! protocol's cost.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use vkd_provider::{LogRequest, Provider, StreamIo, TermSize};

use crate::convert::{self, status_of};
use crate::pb::provider_server::{Provider as Service, ProviderServer};
use crate::{CHUNK, Endpoint, GrpcError, MAX_MESSAGE, VERSION, pb, pump};

type Answer<T> = Result<Response<T>, Status>;
type Outgoing<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The protocol's service over `provider`.
pub struct Served {
    provider: Arc<dyn Provider>,
    /// Ends the streams that would outlive a shutdown (events, followed
    /// logs, sessions): the server's graceful stop waits for every call.
    shutdown: CancellationToken,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("provider", &self.provider.name())
            .finish()
    }
}

/// Serves `provider` on `endpoint` until `shutdown`. A Unix socket is made
/// anew (a stale one from a crash is replaced), 0600, in a directory no one
/// else can write, and only root or this process's user is served on it
/// ([`crate::socket`]); `tls://` serves only clients of its CA.
pub async fn serve(
    provider: Arc<dyn Provider>,
    endpoint: &Endpoint,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<Result<(), GrpcError>>, GrpcError> {
    let service = ProviderServer::new(Served {
        provider,
        shutdown: shutdown.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE)
    .max_encoding_message_size(MAX_MESSAGE);
    let router = tonic::transport::Server::builder().add_service(service);
    let accepting = shutdown.clone();
    let signal = async move { shutdown.cancelled().await };
    Ok(match endpoint {
        Endpoint::Unix { path, peer_uid } => {
            // Who may dial is the socket's mode and the peer check: a
            // plugin's socket is its own user's alone.
            if peer_uid.is_some() {
                return Err(GrpcError::Endpoint(
                    endpoint.to_string(),
                    "peer-uid is for the side that dials (vkd); a plugin's socket is its own user's (and root's) alone".into(),
                ));
            }
            let incoming = crate::socket::accept(crate::socket::bind(path)?);
            tokio::spawn(async move {
                router
                    .serve_with_incoming_shutdown(incoming, signal)
                    .await
                    .map_err(|e| GrpcError::Serve(e.to_string()))
            })
        }
        Endpoint::Tls { host, port, files } => {
            let config = files.server_config()?;
            let listener = tokio::net::TcpListener::bind((host.as_str(), *port))
                .await
                .map_err(|e| GrpcError::Bind(endpoint.to_string(), e))?;
            let incoming = crate::tls::accept(listener, config, accepting);
            tokio::spawn(async move {
                router
                    .serve_with_incoming_shutdown(incoming, signal)
                    .await
                    .map_err(|e| GrpcError::Serve(e.to_string()))
            })
        }
    })
}

fn err(e: &vkd_provider::ProviderError) -> Status {
    status_of(e)
}

fn invalid(what: String) -> Status {
    Status::invalid_argument(what)
}

fn stdout_msg(b: Vec<u8>) -> pb::StreamOut {
    pb::StreamOut {
        msg: Some(pb::stream_out::Msg::Stdout(b)),
    }
}

fn stderr_msg(b: Vec<u8>) -> pb::StreamOut {
    pb::StreamOut {
        msg: Some(pb::stream_out::Msg::Stderr(b)),
    }
}

impl Served {
    /// `stream`, ended at shutdown.
    fn until_shutdown<T, S>(&self, stream: S) -> Outgoing<T>
    where
        S: Stream<Item = Result<T, Status>> + Send + 'static,
        T: 'static,
    {
        Box::pin(stream.take_until(self.shutdown.clone().cancelled_owned()))
    }

    /// Exec or attach: the client's first message says what; its stdin and
    /// resizes are fed in while the provider runs; stdout, stderr and the
    /// exit code go back.
    async fn session(
        &self,
        mut incoming: Streaming<pb::StreamIn>,
        exec: bool,
    ) -> Answer<Outgoing<pb::StreamOut>> {
        let Some(pb::stream_in::Msg::Start(start)) = incoming.message().await?.and_then(|m| m.msg)
        else {
            return Err(invalid("the first message of a stream is its start".into()));
        };
        let (out_tx, out_rx) = mpsc::channel(16);
        let (stdin_reader, mut stdin_writer) = tokio::io::duplex(CHUNK);
        let (resize_tx, resize_rx) = mpsc::channel::<TermSize>(4);
        let (stdout, stdout_reader) = if start.stdout {
            let (w, r) = tokio::io::duplex(CHUNK);
            (Some(Box::new(w) as vkd_provider::BoxWrite), Some(r))
        } else {
            (None, None)
        };
        let (stderr, stderr_reader) = if start.stderr && !start.tty {
            let (w, r) = tokio::io::duplex(CHUNK);
            (Some(Box::new(w) as vkd_provider::BoxWrite), Some(r))
        } else {
            (None, None)
        };
        let io = StreamIo {
            stdin: start
                .stdin
                .then(|| Box::new(stdin_reader) as vkd_provider::BoxRead),
            stdout,
            stderr,
            tty: start.tty,
            resize: start.tty.then_some(resize_rx),
        };
        // The client's side: stdin bytes, its end, resizes.
        tokio::spawn(async move {
            while let Ok(Some(m)) = incoming.message().await {
                let taken = match m.msg {
                    Some(pb::stream_in::Msg::Stdin(b)) => stdin_writer.write_all(&b).await.is_ok(),
                    Some(pb::stream_in::Msg::StdinEnd(_)) => {
                        let _ = stdin_writer.shutdown().await;
                        true
                    }
                    Some(pb::stream_in::Msg::Resize(s)) => {
                        let size = TermSize {
                            width: u16::try_from(s.width).unwrap_or(u16::MAX),
                            height: u16::try_from(s.height).unwrap_or(u16::MAX),
                        };
                        let _ = resize_tx.try_send(size);
                        true
                    }
                    _ => true,
                };
                if !taken {
                    break;
                }
            }
        });
        let provider = Arc::clone(&self.provider);
        tokio::spawn(async move {
            // The output pumps end when the provider drops its writers.
            let outputs = [
                stdout_reader.map(|r| (r, stdout_msg as fn(Vec<u8>) -> pb::StreamOut)),
                stderr_reader.map(|r| (r, stderr_msg as fn(Vec<u8>) -> pb::StreamOut)),
            ];
            let pumps: Vec<_> = outputs
                .into_iter()
                .flatten()
                .map(|(r, wrap)| {
                    let tx = out_tx.clone();
                    tokio::spawn(async move { pump(r, &tx, |b| Ok(wrap(b))).await })
                })
                .collect();
            let outcome = if exec {
                provider
                    .exec(&start.uid, &start.container, start.command, io)
                    .await
            } else {
                provider
                    .attach(&start.uid, &start.container, io)
                    .await
                    .map(|()| 0)
            };
            // Everything written before the end goes out before it.
            for p in pumps {
                let _ = p.await;
            }
            let last = match outcome {
                Ok(code) => Ok(pb::StreamOut {
                    msg: Some(pb::stream_out::Msg::Exit(code)),
                }),
                Err(e) => Err(err(&e)),
            };
            let _ = out_tx.send(last).await;
        });
        Ok(Response::new(
            self.until_shutdown(ReceiverStream::new(out_rx)),
        ))
    }
}

#[tonic::async_trait]
impl Service for Served {
    async fn hello(&self, request: Request<pb::HelloRequest>) -> Answer<pb::HelloReply> {
        let offered = request.into_inner().versions;
        if !offered.contains(&VERSION) {
            return Err(Status::failed_precondition(format!(
                "this plugin speaks protocol version {VERSION}; the caller offered {offered:?}"
            )));
        }
        Ok(Response::new(pb::HelloReply {
            version: VERSION,
            name: self.provider.name().to_owned(),
            capabilities: convert::capability_names(&self.provider.capabilities()),
            identity: self.provider.identity().into_iter().collect(),
        }))
    }

    async fn health(&self, _: Request<pb::Empty>) -> Answer<pb::HealthReply> {
        Ok(Response::new(convert::health_msg(
            &self.provider.health().await,
        )))
    }

    async fn capacity(&self, _: Request<pb::Empty>) -> Answer<pb::Document> {
        let cap = self.provider.capacity().await.map_err(|e| err(&e))?;
        Ok(Response::new(convert::document(&cap).map_err(|e| err(&e))?))
    }

    async fn admit(&self, request: Request<pb::Document>) -> Answer<pb::AdmitReply> {
        let spec =
            convert::read_document(Some(&request.into_inner()), "InstanceSpec").map_err(invalid)?;
        let a = self.provider.admit(&spec).await.map_err(|e| err(&e))?;
        Ok(Response::new(convert::admission_msg(&a)))
    }

    async fn create(&self, request: Request<pb::CreateRequest>) -> Answer<pb::Document> {
        let r = request.into_inner();
        let fence = convert::fence_of(r.fence)?;
        let spec = convert::read_document(r.spec.as_ref(), "InstanceSpec").map_err(invalid)?;
        let instance = self
            .provider
            .create(&fence, &spec)
            .await
            .map_err(|e| err(&e))?;
        Ok(Response::new(
            convert::document(&instance).map_err(|e| err(&e))?,
        ))
    }

    async fn get(&self, request: Request<pb::UidRequest>) -> Answer<pb::GetReply> {
        let found = self
            .provider
            .get(&request.into_inner().uid)
            .await
            .map_err(|e| err(&e))?;
        let instance = found
            .map(|i| convert::document(&i))
            .transpose()
            .map_err(|e| err(&e))?;
        Ok(Response::new(pb::GetReply { instance }))
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Answer<pb::Empty> {
        let r = request.into_inner();
        let fence = convert::fence_of(r.fence)?;
        self.provider
            .delete(&fence, &r.uid, convert::grace_of(r.grace_millis))
            .await
            .map_err(|e| err(&e))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn delete_instance(
        &self,
        request: Request<pb::DeleteInstanceRequest>,
    ) -> Answer<pb::Empty> {
        let r = request.into_inner();
        let fence = convert::fence_of(r.fence)?;
        self.provider
            .delete_instance(&fence, &r.id, convert::grace_of(r.grace_millis))
            .await
            .map_err(|e| err(&e))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn takeover(&self, request: Request<pb::Fence>) -> Answer<pb::Empty> {
        let fence = convert::fence_of(Some(request.into_inner()))?;
        self.provider.takeover(&fence).await.map_err(|e| err(&e))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn list(&self, request: Request<pb::ListRequest>) -> Answer<pb::Document> {
        let list = self
            .provider
            .list(&request.into_inner().node)
            .await
            .map_err(|e| err(&e))?;
        Ok(Response::new(
            convert::document(&list).map_err(|e| err(&e))?,
        ))
    }

    type EventsStream = Outgoing<pb::Event>;

    async fn events(&self, _: Request<pb::Empty>) -> Answer<Self::EventsStream> {
        let events = self.provider.events().map(|e| Ok(convert::event_msg(&e)));
        Ok(Response::new(self.until_shutdown(events)))
    }

    type LogsStream = Outgoing<pb::LogChunk>;

    async fn logs(&self, request: Request<pb::LogsRequest>) -> Answer<Self::LogsStream> {
        let r = request.into_inner();
        let req = LogRequest {
            previous: r.previous,
            follow: r.follow,
            tail_lines: r.tail_lines,
            since: r.since_unix_nanos.map(convert::time_of),
            limit_bytes: r.limit_bytes,
        };
        let logs = self
            .provider
            .logs(&r.uid, &r.container, req)
            .await
            .map_err(|e| err(&e))?;
        let line = |l: &vkd_provider::LogLine| {
            Ok(pb::LogChunk {
                item: Some(pb::log_chunk::Item::Line(convert::log_line_msg(l))),
            })
        };
        let history: Vec<_> = logs.history.iter().map(line).collect();
        let end = Ok(pb::LogChunk {
            item: Some(pb::log_chunk::Item::HistoryEnd(true)),
        });
        let head = futures::stream::iter(history.into_iter().chain([end]));
        let stream: Self::LogsStream = match logs.follow {
            Some(follow) => self.until_shutdown(head.chain(follow.map(move |l| line(&l)))),
            None => Box::pin(head),
        };
        Ok(Response::new(stream))
    }

    type ExecStream = Outgoing<pb::StreamOut>;

    async fn exec(&self, request: Request<Streaming<pb::StreamIn>>) -> Answer<Self::ExecStream> {
        self.session(request.into_inner(), true).await
    }

    type AttachStream = Outgoing<pb::StreamOut>;

    async fn attach(
        &self,
        request: Request<Streaming<pb::StreamIn>>,
    ) -> Answer<Self::AttachStream> {
        self.session(request.into_inner(), false).await
    }

    type PortForwardStream = Outgoing<pb::ForwardOut>;

    async fn port_forward(
        &self,
        request: Request<Streaming<pb::ForwardIn>>,
    ) -> Answer<Self::PortForwardStream> {
        let mut incoming = request.into_inner();
        let Some(pb::forward_in::Msg::Start(start)) = incoming.message().await?.and_then(|m| m.msg)
        else {
            return Err(invalid(
                "the first message of a port-forward is its start".into(),
            ));
        };
        let port = u16::try_from(start.port)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| invalid(format!("port {} is not 1 to 65535", start.port)))?;
        let (ours, theirs) = tokio::io::duplex(CHUNK);
        let (read_half, mut write_half) = tokio::io::split(ours);
        let (out_tx, out_rx) = mpsc::channel(16);
        tokio::spawn(async move {
            while let Ok(Some(m)) = incoming.message().await {
                let taken = match m.msg {
                    Some(pb::forward_in::Msg::Data(b)) => write_half.write_all(&b).await.is_ok(),
                    Some(pb::forward_in::Msg::End(_)) => {
                        let _ = write_half.shutdown().await;
                        true
                    }
                    _ => true,
                };
                if !taken {
                    break;
                }
            }
        });
        let tx = out_tx.clone();
        tokio::spawn(async move { pump(read_half, &tx, |data| Ok(pb::ForwardOut { data })).await });
        let provider = Arc::clone(&self.provider);
        tokio::spawn(async move {
            if let Err(e) = provider
                .port_forward(&start.uid, port, Box::new(theirs))
                .await
            {
                let _ = out_tx.send(Err(err(&e))).await;
            }
        });
        Ok(Response::new(
            self.until_shutdown(ReceiverStream::new(out_rx)),
        ))
    }

    async fn start_ephemeral(
        &self,
        request: Request<pb::StartEphemeralRequest>,
    ) -> Answer<pb::Empty> {
        let r = request.into_inner();
        let fence = convert::fence_of(r.fence)?;
        let container =
            convert::read_document(r.container.as_ref(), "ContainerSpec").map_err(invalid)?;
        self.provider
            .start_ephemeral(&fence, &r.uid, &container)
            .await
            .map_err(|e| err(&e))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn update_volumes(
        &self,
        request: Request<pb::UpdateVolumesRequest>,
    ) -> Answer<pb::Empty> {
        let r = request.into_inner();
        let fence = convert::fence_of(r.fence)?;
        let volumes: Vec<vkd_provider::Volume> =
            convert::read_document(r.volumes.as_ref(), "Volume list").map_err(invalid)?;
        self.provider
            .update_volumes(&fence, &r.uid, &volumes)
            .await
            .map_err(|e| err(&e))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn stats(&self, request: Request<pb::UidRequest>) -> Answer<pb::Document> {
        let stats = self
            .provider
            .stats(&request.into_inner().uid)
            .await
            .map_err(|e| err(&e))?;
        Ok(Response::new(
            convert::document(&stats).map_err(|e| err(&e))?,
        ))
    }

    async fn describe(&self, request: Request<pb::UidRequest>) -> Answer<pb::DescribeReply> {
        let pairs = self
            .provider
            .describe(&request.into_inner().uid)
            .await
            .map_err(|e| err(&e))?
            .into_iter()
            .map(|(what, value)| pb::describe_reply::Pair { what, value })
            .collect();
        Ok(Response::new(pb::DescribeReply { pairs }))
    }
}
