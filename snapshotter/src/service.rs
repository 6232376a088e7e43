//! containerd's snapshots gRPC service on top of [`SnapshotStore`], and the
//! Unix-socket server that containerd's `proxy_plugins` connect to.

use crate::api::snapshots::snapshots_server::{Snapshots, SnapshotsServer};
use crate::api::snapshots::{
    self as pb, CleanupRequest, CommitSnapshotRequest, ListSnapshotsRequest, ListSnapshotsResponse,
    MountsRequest, MountsResponse, PrepareSnapshotRequest, PrepareSnapshotResponse,
    RemoveSnapshotRequest, StatSnapshotRequest, StatSnapshotResponse, UpdateSnapshotRequest,
    UpdateSnapshotResponse, UsageRequest, UsageResponse, ViewSnapshotRequest, ViewSnapshotResponse,
};
use crate::api::types;
use crate::error::Error;
use crate::filter::Filter;
use crate::store::{Info, Kind, Mount, SnapshotStore};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

/// How many snapshot infos go into one streamed `List` reply.
const LIST_BATCH: usize = 100;

/// The gRPC service: each call runs its blocking store work off the reactor.
#[derive(Clone)]
pub struct SnapshotService {
    store: Arc<SnapshotStore>,
}

impl SnapshotService {
    /// The gRPC service over `store`.
    pub fn new(store: Arc<SnapshotStore>) -> SnapshotService {
        SnapshotService { store }
    }

    async fn run<T, F>(&self, op: &'static str, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&SnapshotStore) -> Result<T, Error> + Send + 'static,
    {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| Status::internal(format!("{op}: worker failed: {e}")))?
            .map_err(|e| {
                tracing::debug!(op, error = %e, "request failed");
                status(e)
            })
    }
}

/// Maps store errors to the gRPC codes containerd's errdefs understand.
fn status(e: Error) -> Status {
    let msg = e.to_string();
    match e {
        Error::NotFound(_) => Status::not_found(msg),
        Error::AlreadyExists(_) => Status::already_exists(msg),
        Error::FailedPrecondition(_) => Status::failed_precondition(msg),
        Error::InvalidArgument(_) => Status::invalid_argument(msg),
        Error::PermissionDenied(_) => Status::permission_denied(msg),
        Error::NoSpace { .. } => Status::resource_exhausted(msg),
        Error::Locked(_) => Status::unavailable(msg),
        Error::NoReflink { .. } | Error::Tool { .. } | Error::Corrupt { .. } | Error::Io { .. } => {
            Status::internal(msg)
        }
    }
}

fn labels(map: HashMap<String, String>) -> BTreeMap<String, String> {
    map.into_iter().collect()
}

fn parent(p: &str) -> Option<String> {
    (!p.is_empty()).then(|| p.to_string())
}

fn mounts(ms: Vec<Mount>) -> Vec<types::Mount> {
    ms.into_iter()
        .map(|m| types::Mount {
            r#type: m.fstype,
            source: m.source.to_string_lossy().into_owned(),
            target: String::new(),
            options: m.options,
        })
        .collect()
}

fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

fn system_time(t: Option<prost_types::Timestamp>) -> SystemTime {
    t.and_then(|t| {
        let secs = u64::try_from(t.seconds).ok()?;
        let nanos = u32::try_from(t.nanos).ok()?;
        UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
    })
    .unwrap_or(UNIX_EPOCH)
}

fn to_pb(i: Info) -> pb::Info {
    pb::Info {
        name: i.name,
        parent: i.parent.unwrap_or_default(),
        kind: match i.kind {
            Kind::View => pb::Kind::View,
            Kind::Active => pb::Kind::Active,
            Kind::Committed => pb::Kind::Committed,
        } as i32,
        created_at: Some(timestamp(i.created)),
        updated_at: Some(timestamp(i.updated)),
        labels: i.labels.into_iter().collect(),
    }
}

fn from_pb(i: pb::Info) -> Info {
    Info {
        name: i.name,
        parent: parent(&i.parent),
        kind: match pb::Kind::try_from(i.kind) {
            Ok(pb::Kind::View) => Kind::View,
            Ok(pb::Kind::Committed) => Kind::Committed,
            _ => Kind::Active,
        },
        created: system_time(i.created_at),
        updated: system_time(i.updated_at),
        labels: labels(i.labels),
    }
}

type ListStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<ListSnapshotsResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Snapshots for SnapshotService {
    async fn prepare(
        &self,
        req: Request<PrepareSnapshotRequest>,
    ) -> Result<Response<PrepareSnapshotResponse>, Status> {
        let r = req.into_inner();
        let ms = self
            .run("prepare", move |s| {
                s.prepare(&r.key, parent(&r.parent).as_deref(), labels(r.labels))
            })
            .await?;
        Ok(Response::new(PrepareSnapshotResponse {
            mounts: mounts(ms),
        }))
    }

    async fn view(
        &self,
        req: Request<ViewSnapshotRequest>,
    ) -> Result<Response<ViewSnapshotResponse>, Status> {
        let r = req.into_inner();
        let ms = self
            .run("view", move |s| {
                s.view(&r.key, parent(&r.parent).as_deref(), labels(r.labels))
            })
            .await?;
        Ok(Response::new(ViewSnapshotResponse { mounts: mounts(ms) }))
    }

    async fn mounts(
        &self,
        req: Request<MountsRequest>,
    ) -> Result<Response<MountsResponse>, Status> {
        let r = req.into_inner();
        let ms = self.run("mounts", move |s| s.mounts(&r.key)).await?;
        Ok(Response::new(MountsResponse { mounts: mounts(ms) }))
    }

    async fn commit(&self, req: Request<CommitSnapshotRequest>) -> Result<Response<()>, Status> {
        let r = req.into_inner();
        self.run("commit", move |s| {
            s.commit(&r.name, &r.key, labels(r.labels))
        })
        .await?;
        Ok(Response::new(()))
    }

    async fn remove(&self, req: Request<RemoveSnapshotRequest>) -> Result<Response<()>, Status> {
        let r = req.into_inner();
        self.run("remove", move |s| s.remove(&r.key)).await?;
        Ok(Response::new(()))
    }

    async fn stat(
        &self,
        req: Request<StatSnapshotRequest>,
    ) -> Result<Response<StatSnapshotResponse>, Status> {
        let r = req.into_inner();
        let info = self.run("stat", move |s| s.stat(&r.key)).await?;
        Ok(Response::new(StatSnapshotResponse {
            info: Some(to_pb(info)),
        }))
    }

    async fn update(
        &self,
        req: Request<UpdateSnapshotRequest>,
    ) -> Result<Response<UpdateSnapshotResponse>, Status> {
        let r = req.into_inner();
        let info = r
            .info
            .ok_or_else(|| Status::invalid_argument("update: info is required"))?;
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        let info = from_pb(info);
        let out = self.run("update", move |s| s.update(&info, &paths)).await?;
        Ok(Response::new(UpdateSnapshotResponse {
            info: Some(to_pb(out)),
        }))
    }

    type ListStream = ListStream;

    async fn list(
        &self,
        req: Request<ListSnapshotsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let filters = req
            .into_inner()
            .filters
            .iter()
            .map(|f| Filter::parse(f))
            .collect::<Result<Vec<_>, _>>()
            .map_err(status)?;
        let infos = self.run("list", move |s| Ok(s.list(&filters))).await?;
        let batches: Vec<Result<ListSnapshotsResponse, Status>> = infos
            .chunks(LIST_BATCH)
            .map(|c| {
                Ok(ListSnapshotsResponse {
                    info: c.iter().cloned().map(to_pb).collect(),
                })
            })
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(batches))))
    }

    async fn usage(&self, req: Request<UsageRequest>) -> Result<Response<UsageResponse>, Status> {
        let r = req.into_inner();
        let u = self.run("usage", move |s| s.usage(&r.key)).await?;
        Ok(Response::new(UsageResponse {
            size: i64::try_from(u.size).unwrap_or(i64::MAX),
            inodes: i64::try_from(u.inodes).unwrap_or(i64::MAX),
        }))
    }

    async fn cleanup(&self, _req: Request<CleanupRequest>) -> Result<Response<()>, Status> {
        let removed = self.run("cleanup", |s| s.cleanup()).await?;
        tracing::info!(removed, "cleanup");
        Ok(Response::new(()))
    }
}

/// Serves `store` on the Unix socket `socket` until `shutdown` resolves.
/// A stale socket file is replaced.
pub async fn serve(
    store: Arc<SnapshotStore>,
    socket: &Path,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("removing stale {}", socket.display()), e)),
    }
    let listener = UnixListener::bind(socket)
        .map_err(|e| Error::io(format!("listening on {}", socket.display()), e))?;
    tracing::info!(socket = %socket.display(), "serving containerd snapshots API");
    tonic::transport::Server::builder()
        .add_service(SnapshotsServer::new(SnapshotService::new(store)))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await
        .map_err(|e| Error::Io {
            context: format!("serving on {}", socket.display()),
            source: std::io::Error::other(e),
        })?;
    let _ = std::fs::remove_file(socket);
    Ok(())
}
