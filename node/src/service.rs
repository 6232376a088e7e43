//! The daemon's ttrpc services on one socket: `twig.v1.Node` (the
//! controller's: snapshots and templates of the node store) and
//! `twig.node.v1.Pool` (the shims': a prepared VMM and the template to
//! restore into it).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ttrpc::r#async::TtrpcContext;
use twig_proto::node::{
    AcquireNetSetRequest, AcquireNetSetResponse, AcquireVmRequest, AcquireVmResponse, BaseShape,
    PoolLevel, StatusRequest, StatusResponse,
};
use twig_proto::twig::{
    CollectGarbageRequest, CollectGarbageResponse, DeleteSnapshotRequest, DeleteSnapshotResponse,
    DeleteTemplateRequest, DeleteTemplateResponse, EnsureTemplateRequest, EnsureTemplateResponse,
    ExportSnapshotRequest, ExportSnapshotResponse, GetSnapshotRequest, GetSnapshotResponse,
    GetStoreUsageRequest, GetStoreUsageResponse, ImportSnapshotRequest, ImportSnapshotResponse,
    RetainSnapshotRequest, RetainSnapshotResponse, SnapshotInfo,
};

use crate::build::{template_id, Builder, Progress, Spec, SPEC_LABEL};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::gc::{garbage, Claims, RETAINED_LABEL};
use crate::lazy;
use crate::netpool::NetPool;
use crate::pool::{Owner, Pool};
use crate::registry::Registry;
use crate::shape::{check_fits, choose, Need};
use crate::template::{list, Shape, TemplateRef, Templates, BASE_PREFIX};
use twig_store::layout::{TEMPLATE_ID_PREFIX, TEMPLATE_POLICY_LABEL};

/// The state both services share.
#[derive(Clone)]
pub struct Services {
    templates: Arc<Templates>,
    pool: Pool,
    builder: Arc<Builder>,
    net: Option<Arc<NetPool>>,
    /// Snapshots an `AcquireVm` is taking and snapshots being deleted.
    claims: Arc<Claims>,
    /// Where snapshots are exported to and imported from.
    registry: Arc<Registry>,
}

/// What one garbage collection deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Collected {
    /// The snapshots deleted, children before their parents.
    pub deleted: Vec<String>,
    /// Allocated bytes of their files.
    pub reclaimed_bytes: u64,
}

/// The process whose exit kills the VMM handed over for `req`, if any.
fn owner_of(req: &AcquireVmRequest) -> Result<Option<Owner>> {
    match req.owner_pid {
        0 => Ok(None),
        pid => Owner::open(pid)
            .map(Some)
            .map_err(|e| Error::InvalidArgument(format!("owner_pid {pid}: {e}"))),
    }
}

/// What a shim is told of the VMM `vmm` handed over to restore `t`.
fn handed_over(vmm: &crate::pool::Vmm, t: &TemplateRef, pooled: bool) -> AcquireVmResponse {
    AcquireVmResponse {
        api_socket: path_string(&vmm.api_socket()),
        vsock_socket: path_string(&vmm.vsock_socket()),
        pid: vmm.pid,
        state_dir: path_string(&vmm.dir),
        template_dir: path_string(&t.dir),
        memory_mib: t.shape.mem_mib,
        vcpus: t.shape.vcpus,
        disk_slots: t.shape.disk_slots,
        pooled,
        ..Default::default()
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("a blocking task failed: {e}")))?
}

impl Services {
    /// The services over a node store, a VMM pool, the template builds
    /// and a pool of twig-net program sets (none: every shim loads its own).
    pub fn new(
        templates: Arc<Templates>,
        pool: Pool,
        builder: Arc<Builder>,
        net: Option<Arc<NetPool>>,
        registry: Arc<Registry>,
    ) -> Services {
        Services {
            templates,
            pool,
            builder,
            net,
            claims: Arc::new(Claims::default()),
            registry,
        }
    }

    /// Refuses `req` unless the shape it asks for, if any, is snapshot
    /// `t`'s and its resources fit that.
    fn check_snapshot_shape(&self, req: &AcquireVmRequest, t: &TemplateRef) -> Result<()> {
        for (what, asked, is) in [
            ("memory_mib", req.memory_mib, t.shape.mem_mib),
            ("vcpus", req.vcpus, t.shape.vcpus),
            ("disk_slots", req.disk_slots, t.shape.disk_slots),
        ] {
            if asked != 0 && asked != is {
                return Err(Error::InvalidArgument(format!(
                    "{what} {asked} asked for, but snapshot {:?} is {}",
                    t.id, t.shape
                )));
            }
        }
        let need = Need {
            memory_limit_bytes: req.memory_limit_bytes,
            cpu_limit_millis: req.cpu_limit_millis,
        };
        let reserve = self.templates.guest_reserve_mib();
        check_fits(t.shape, &format!("snapshot {:?}", t.id), &need, reserve)
    }

    /// The VM `req` asks for: its template (the base template of the
    /// chosen shape; else the app template `req.template`, or the pod
    /// snapshot `req.restore_from` with its own shape) and the snapshots
    /// it uses. Nothing is taken from the pool here.
    async fn template_for(&self, req: &AcquireVmRequest) -> Result<(TemplateRef, Vec<String>)> {
        let need = Need {
            memory_limit_bytes: req.memory_limit_bytes,
            cpu_limit_millis: req.cpu_limit_millis,
        };
        let reserve = self.templates.guest_reserve_mib();
        let templates = self.templates.clone();
        if !req.restore_from.is_empty() || !req.template.is_empty() {
            // A snapshot restores only into its own shape: the pod keeps it.
            let name = if req.restore_from.is_empty() {
                req.template.clone()
            } else {
                req.restore_from.clone()
            };
            let restore = !req.restore_from.is_empty();
            let t = blocking(move || {
                templates.app(&name).map_err(|e| match e {
                    Error::NotFound(_) if restore => {
                        Error::NotFound(format!("snapshot {name:?} is not in this node's store"))
                    }
                    e => e,
                })
            })
            .await?;
            self.check_snapshot_shape(req, &t)?;
            let mut uses = vec![t.id.clone()];
            if !req.template.is_empty() && req.template != t.id {
                uses.push(req.template.clone());
            }
            return Ok((t, uses));
        }
        let default = self.templates.default_shape();
        if req.disk_slots != 0 && req.disk_slots != default.disk_slots {
            return Err(Error::InvalidArgument(format!(
                "disk_slots {} asked for, but every VM of this node has {}",
                req.disk_slots, default.disk_slots
            )));
        }
        let offered = self.templates.offered();
        let shape = if req.memory_mib == 0 && req.vcpus == 0 {
            choose(&offered, default, &need, reserve)?
        } else {
            let exact = Shape::asked(default, req.memory_mib, req.vcpus);
            if !offered.contains(&exact) {
                return Err(Error::InvalidArgument(format!(
                    "{exact} asked for is not a VM shape of this node; it offers {}",
                    list(&offered)
                )));
            }
            check_fits(exact, "the VM shape asked for", &need, reserve)?;
            exact
        };
        let (pool, claims) = (self.pool.clone(), self.claims.clone());
        let t = blocking(move || {
            // A previous base a running VM was restored from stays.
            templates.base_with(shape, |id| {
                let _deleting = claims.delete(id, || pool.users_of(id))?;
                Ok(templates.store().delete(id)?)
            })
        })
        .await?;
        let uses = vec![t.id.clone()];
        Ok((t, uses))
    }

    /// Whether `req` restores from an artifact whose snapshot the store
    /// lacks (so it must be pulled).
    async fn must_pull(&self, req: &AcquireVmRequest) -> Result<bool> {
        if req.restore_artifact.is_empty() {
            return Ok(false);
        }
        if req.restore_from.is_empty() {
            return Err(Error::InvalidArgument(
                "restore_artifact names where restore_from was exported: it needs restore_from"
                    .into(),
            ));
        }
        let templates = self.templates.clone();
        let id = req.restore_from.clone();
        blocking(move || match templates.store().get(&id) {
            Ok(_) => Ok(false),
            Err(twig_store::Error::NotFound(_)) => Ok(true),
            Err(e) => Err(e.into()),
        })
        .await
    }

    /// `req`, its `restore_from` pulled from `restore_artifact` when the
    /// store lacks it (and then naming the pulled snapshot).
    async fn pulled_if_missing(&self, req: &AcquireVmRequest) -> Result<AcquireVmRequest> {
        let mut req = req.clone();
        if self.must_pull(&req).await? {
            let pulled = self
                .registry
                .import(
                    self.templates.store(),
                    &req.restore_artifact,
                    &req.namespace,
                )
                .await?;
            tracing::info!(
                sandbox = req.sandbox_id,
                restore_from = req.restore_from,
                id = pulled.snapshot_id,
                bytes = pulled.bytes_downloaded,
                "pulled a snapshot this node lacked"
            );
            req.restore_from = pulled.snapshot_id;
        }
        Ok(req)
    }

    /// Pulls template `spec` from `artifact` under its id, keeping it only
    /// when it was built from the same inputs (its spec label), with this
    /// node's egress policy for its pods.
    async fn template_from_registry(&self, spec: &Spec, artifact: &str) -> Result<()> {
        let (namespace, _) = spec.key.split_once('/').ok_or_else(|| {
            Error::InvalidArgument(format!(
                "template name {:?} is not namespace/name",
                spec.key
            ))
        })?;
        self.registry
            .import_as(self.templates.store(), artifact, namespace, &spec.id)
            .await?;
        let templates = self.templates.clone();
        let (id, digest, policy) = (
            spec.id.clone(),
            spec.digest.clone(),
            spec.egress_policy.clone(),
        );
        blocking(move || {
            let store = templates.store();
            let theirs = store.get(&id)?.labels.get(SPEC_LABEL).cloned();
            if theirs.as_deref() != Some(digest.as_str()) {
                store.delete(&id)?;
                return Err(Error::FailedPrecondition(format!(
                    "it was built from other inputs (spec {}) than this node's (spec {digest}): \
                     another image, command, warm-up or base template (guest kernel, agent, shape)",
                    theirs.as_deref().unwrap_or("unknown")
                )));
            }
            Ok(store.set_label(&id, TEMPLATE_POLICY_LABEL, policy.as_deref())?)
        })
        .await
    }

    /// Hands over a VMM for `req` restoring, lazily, the snapshot of
    /// `req.restore_artifact` this node lacks: its state and disks pulled
    /// and staged, its memory served by a page server while the rest
    /// arrives (see [`crate::lazy`]).
    async fn acquire_lazy(
        &self,
        req: &AcquireVmRequest,
        run_dir: &Path,
    ) -> Result<AcquireVmResponse> {
        let store = self.templates.store();
        let pull = self
            .registry
            .import_lazy(store, &req.restore_artifact, &req.namespace)
            .await?;
        if !pull.is_staged() {
            // The store has it (under its pulled id): restored as usual.
            let req = AcquireVmRequest {
                restore_from: pull.id.clone(),
                restore_artifact: String::new(),
                ..req.clone()
            };
            return self.acquire_local(&req).await;
        }
        let templates = self.templates.clone();
        let dir = pull.dir.clone();
        let t = blocking(move || {
            let staged = templates.store().staged(&dir)?;
            templates.staged(&staged)
        })
        .await?;
        self.check_snapshot_shape(req, &t)?;
        let owner = owner_of(req)?;
        let (vmm, pooled) = self.pool.take(t.shape, &[], owner.as_ref()).await?;
        let socket = self
            .pool
            .use_staged(&vmm, store, &t.dir, &t.id)
            .and_then(|()| {
                lazy::serve(
                    run_dir,
                    &req.sandbox_id,
                    pull,
                    self.registry.fill_pace(),
                    tokio::runtime::Handle::current(),
                )
            })
            .inspect_err(|_| crate::pool::kill(vmm.pid))?;
        tracing::info!(
            sandbox = req.sandbox_id,
            restore_from = req.restore_from,
            id = t.id,
            pid = vmm.pid,
            pooled,
            "handed over a VMM restoring lazily what it pulls"
        );
        Ok(AcquireVmResponse {
            restored_id: t.id.clone(),
            lazy_socket: path_string(&socket),
            ..handed_over(&vmm, &t, pooled)
        })
    }

    /// Hands over a prepared VMM for `req`.
    pub async fn acquire(&self, req: &AcquireVmRequest) -> Result<AcquireVmResponse> {
        if let Some(run_dir) = self.registry.lazy_dir() {
            if self.must_pull(req).await? {
                return self.acquire_lazy(req, run_dir).await;
            }
        }
        let req = &self.pulled_if_missing(req).await?;
        self.acquire_local(req).await
    }

    /// Hands over a prepared VMM for `req`, whose snapshots are in the
    /// store.
    async fn acquire_local(&self, req: &AcquireVmRequest) -> Result<AcquireVmResponse> {
        // Claimed before the store is read, until the VM's lease holds
        // them: a deletion between the two is refused, or refuses this.
        let named: Vec<String> = [&req.restore_from, &req.template]
            .into_iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect();
        let _claim = self.claims.claim(&named)?;
        let (t, uses) = self.template_for(req).await?;
        let owner = owner_of(req)?;
        let (vmm, pooled) = self.pool.take(t.shape, &uses, owner.as_ref()).await?;
        tracing::info!(
            sandbox = req.sandbox_id,
            template = t.id,
            shape = %t.shape,
            pid = vmm.pid,
            pooled,
            "handed over a VMM"
        );
        Ok(AcquireVmResponse {
            restored_id: req.restore_from.clone(),
            ..handed_over(&vmm, &t, pooled)
        })
    }

    /// The published snapshot `id`, if the store holds it.
    pub async fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotInfo>> {
        non_empty("snapshot_id", id)?;
        let templates = self.templates.clone();
        let id = id.to_string();
        blocking(move || {
            let store = templates.store();
            let found = store
                .get(&id)
                .and_then(|s| Ok((twig_store::snapshot_sizes(s.dir())?, s)));
            match found {
                Ok((sizes, s)) => Ok(Some(SnapshotInfo {
                    snapshot_id: s.id.clone(),
                    parent_id: s.parent.clone().unwrap_or_default(),
                    size_bytes: s.artefacts.values().sum(),
                    memory_bytes: sizes.memory_bytes,
                    disk_bytes: sizes.disk_bytes,
                    restore_bytes: sizes.restore_bytes,
                    ..Default::default()
                })),
                Err(twig_store::Error::NotFound(_)) => Ok(None),
                // Deleted between reading its manifest and its files.
                Err(twig_store::Error::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    Ok(None)
                }
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    /// The node store's footprint, its filesystem's room, and how many
    /// snapshots and templates (the base template, `base-…`, and app
    /// templates, `template.…`) it holds.
    pub async fn store_usage(&self) -> Result<GetStoreUsageResponse> {
        let templates = self.templates.clone();
        blocking(move || {
            let stats = templates
                .store()
                .stats(|s| s.id.starts_with(BASE_PREFIX) || s.id.starts_with(TEMPLATE_ID_PREFIX))?;
            Ok(GetStoreUsageResponse {
                allocated_bytes: stats.allocated_bytes,
                capacity_bytes: stats.capacity_bytes,
                free_bytes: stats.free_bytes,
                snapshots: stats.snapshots,
                templates: stats.templates,
                ..Default::default()
            })
        })
        .await
    }

    /// Deletes snapshot `id` (a template is one too); gone already is
    /// success. Refused while a VM handed over by this daemon was restored
    /// from it or an `AcquireVm` is taking it (checked atomically with the
    /// acquisition: see [`Claims`]), or another snapshot names it as parent.
    pub async fn delete_snapshot(&self, id: &str) -> Result<()> {
        non_empty("snapshot_id", id)?;
        let pool = self.pool.clone();
        let _deleting = self.claims.delete(id, || pool.users_of(id))?;
        let templates = self.templates.clone();
        let id = id.to_string();
        blocking(move || match templates.store().delete(&id) {
            Ok(()) => {
                tracing::info!(id, "deleted a snapshot");
                Ok(())
            }
            Err(twig_store::Error::NotFound(_)) => Ok(()),
            Err(e) => Err(e.into()),
        })
        .await
    }

    /// Marks snapshot `id` retained (its object was deleted with
    /// `deletionPolicy: Retain`): the garbage collector keeps it. A
    /// snapshot that is not there is no error.
    pub async fn retain_snapshot(&self, id: &str) -> Result<()> {
        non_empty("snapshot_id", id)?;
        let templates = self.templates.clone();
        let id = id.to_string();
        blocking(move || {
            match templates
                .store()
                .set_label(&id, RETAINED_LABEL, Some("true"))
            {
                Ok(()) => Ok(()),
                Err(twig_store::Error::NotFound(_)) => Ok(()),
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    /// Deletes the published snapshots nothing refers to (see
    /// [`crate::gc`] for the roots): not in `referenced`, not a base
    /// template, not retained, not used by a running VM or an acquisition,
    /// not a template being built, not published within `grace`, and not
    /// a parent of any snapshot kept. Each is deleted as `DeleteSnapshot`
    /// would (a snapshot a VM took meanwhile, or that got a child, stays).
    pub async fn collect_garbage(
        &self,
        referenced: &[String],
        grace: std::time::Duration,
    ) -> Result<Collected> {
        let templates = self.templates.clone();
        let all = blocking(move || Ok(templates.store().list()?)).await?;
        let referenced: std::collections::HashSet<&str> =
            referenced.iter().map(String::as_str).collect();
        let now = std::time::SystemTime::now();
        let doomed = garbage(&all, |s| {
            referenced.contains(s.id.as_str())
                || s.id.starts_with(BASE_PREFIX)
                || s.labels.contains_key(RETAINED_LABEL)
                || !self.pool.users_of(&s.id).is_empty()
                || self.claims.taking(&s.id)
                || self.builder.running(&s.id)
                || now
                    .duration_since(s.created)
                    .map_or(true, |age| age < grace)
        });
        let mut collected = Collected::default();
        for id in doomed {
            let templates = self.templates.clone();
            let of = id.clone();
            let bytes = blocking(move || Ok(templates.store().allocated_of(&of)?))
                .await
                .unwrap_or(0);
            match self.delete_snapshot(&id).await {
                Ok(()) => {
                    tracing::info!(id, bytes, "garbage collected a snapshot nothing refers to");
                    collected.reclaimed_bytes += bytes;
                    collected.deleted.push(id);
                }
                Err(e) => tracing::info!(id, "the garbage collector keeps a snapshot: {e}"),
            }
        }
        Ok(collected)
    }

    /// App template `req.name` (`namespace/name`): ready when the store
    /// holds it, built from the same inputs (a template placed in the store
    /// by other means, without the build's label, counts as built) and of
    /// the node's VM shape; otherwise its build is started (or goes on, or
    /// failed) and the answer says so. A template built from other inputs
    /// is deleted and built again once no VM restored from it runs.
    pub async fn ensure_template(
        &self,
        req: &EnsureTemplateRequest,
    ) -> Result<EnsureTemplateResponse> {
        non_empty("name", &req.name)?;
        let base = self.templates.default_shape();
        // Built on the base template; without its inputs (a store filled by
        // other means) a build fails later, saying so.
        let templates = self.templates.clone();
        let spec = match blocking(move || templates.base_id(base)).await {
            Ok(base_id) => Spec::from_request(req)?.built_on(&base_id),
            Err(_) => Spec::from_request(req)?,
        };
        let wanted = Shape::asked(base, req.memory_mib, req.vcpus);
        if wanted != base {
            return Err(Error::FailedPrecondition(format!(
                "template {}: {wanted} asked for, but this node builds app templates in its \
                 default VM shape, {base} (base.mem_mib and base.vcpus of its configuration)",
                spec.key
            )));
        }
        let not_ready = |message: String| EnsureTemplateResponse {
            ready: false,
            message,
            ..Default::default()
        };
        let templates = self.templates.clone();
        let id = spec.id.clone();
        let found = blocking(move || match templates.store().get(&id) {
            Ok(s) => Ok(Some((
                s.labels.get(SPEC_LABEL).cloned(),
                s.labels.get(TEMPLATE_POLICY_LABEL).cloned(),
            ))),
            Err(twig_store::Error::NotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        })
        .await?;
        match found {
            Some((digest, policy)) if digest.as_deref().is_none_or(|d| d == spec.digest) => {
                // Ready once the build is over, its pod removed too.
                if self.builder.running(&spec.id) {
                    return Ok(not_ready(format!(
                        "built from {}; removing the build pod",
                        spec.image
                    )));
                }
                let templates = self.templates.clone();
                let id = spec.id.clone();
                let t = blocking(move || templates.app(&id)).await?;
                if t.shape != base {
                    return Err(Error::FailedPrecondition(format!(
                        "template {} exists as {}, not {base}: delete it first",
                        spec.key, t.shape
                    )));
                }
                // The policy of the template's next pods follows the
                // template's spec without a rebuild (running pods are the
                // controller's to update).
                if policy != spec.egress_policy {
                    let templates = self.templates.clone();
                    let (id, policy) = (spec.id.clone(), spec.egress_policy.clone());
                    blocking(move || {
                        Ok(templates.store().set_label(
                            &id,
                            TEMPLATE_POLICY_LABEL,
                            policy.as_deref(),
                        )?)
                    })
                    .await?;
                    tracing::info!(template = spec.key, "the template's egress policy changed");
                }
                return Ok(EnsureTemplateResponse {
                    ready: true,
                    ..Default::default()
                });
            }
            Some(_) => {
                let users = self.pool.users_of(&spec.id);
                if !users.is_empty() {
                    return Ok(not_ready(format!(
                        "template {} changed; the build of its earlier spec is kept while the \
                         VMs of pids {users:?} restored from it run, and replaced after",
                        spec.key
                    )));
                }
                tracing::info!(
                    template = spec.key,
                    "the template's inputs changed: building it again"
                );
                self.delete_snapshot(&spec.id).await?;
            }
            None => {}
        }
        // Built on another node and exported: pulled instead of built.
        let mut pull_failed = None;
        if !req.artifact.is_empty() && !self.builder.running(&spec.id) {
            match self.template_from_registry(&spec, &req.artifact).await {
                Ok(()) => {
                    return Ok(EnsureTemplateResponse {
                        ready: true,
                        message: format!("pulled from {}", req.artifact),
                        ..Default::default()
                    })
                }
                Err(e) => {
                    tracing::warn!(template = spec.key, artifact = req.artifact, error = %e, "pulling the template failed: building it");
                    pull_failed = Some(format!("pulling {} failed ({e}); ", req.artifact));
                }
            }
        }
        let not_ready =
            |m: String| not_ready(format!("{}{m}", pull_failed.as_deref().unwrap_or("")));
        Ok(match self.builder.ensure(&spec) {
            Progress::Building(m) | Progress::Queued(m) => not_ready(m),
            Progress::Failed(message) => EnsureTemplateResponse {
                message,
                failed: true,
                ..Default::default()
            },
            Progress::NeedsBuildPod(message) => EnsureTemplateResponse {
                message,
                needs_build_pod: true,
                ..Default::default()
            },
        })
    }

    /// Deletes app template `key` (`namespace/name`) from this node and
    /// stops its build (the build pod and its VM stopped and removed
    /// before the template's data is deleted, so a snapshot it took goes
    /// too); refused while a VM restored from it runs.
    pub async fn delete_template(&self, key: &str) -> Result<()> {
        let id = template_id(key)?;
        self.builder.cancel(&id).await?;
        self.delete_snapshot(&id).await
    }
}

fn non_empty(what: &str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::InvalidArgument(format!("{what} is empty")));
    }
    Ok(())
}

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

#[async_trait::async_trait]
impl twig_proto::twig_ttrpc::Node for Services {
    async fn delete_snapshot(
        &self,
        _ctx: &TtrpcContext,
        req: DeleteSnapshotRequest,
    ) -> ttrpc::Result<DeleteSnapshotResponse> {
        Services::delete_snapshot(self, &req.snapshot_id).await?;
        Ok(DeleteSnapshotResponse::default())
    }

    async fn export_snapshot(
        &self,
        _ctx: &TtrpcContext,
        req: ExportSnapshotRequest,
    ) -> ttrpc::Result<ExportSnapshotResponse> {
        non_empty("snapshot_id", &req.snapshot_id)?;
        let store = self.templates.store();
        Ok(self
            .registry
            .export(store, &req.snapshot_id, &req.reference, &req.namespace)
            .await?)
    }

    async fn import_snapshot(
        &self,
        _ctx: &TtrpcContext,
        req: ImportSnapshotRequest,
    ) -> ttrpc::Result<ImportSnapshotResponse> {
        let store = self.templates.store();
        Ok(self
            .registry
            .import(store, &req.reference, &req.namespace)
            .await?)
    }

    async fn get_snapshot(
        &self,
        _ctx: &TtrpcContext,
        req: GetSnapshotRequest,
    ) -> ttrpc::Result<GetSnapshotResponse> {
        let found = Services::get_snapshot(self, &req.snapshot_id).await?;
        Ok(GetSnapshotResponse {
            found: found.is_some(),
            snapshot: found.into(),
            ..Default::default()
        })
    }

    async fn ensure_template(
        &self,
        _ctx: &TtrpcContext,
        req: EnsureTemplateRequest,
    ) -> ttrpc::Result<EnsureTemplateResponse> {
        Ok(Services::ensure_template(self, &req).await?)
    }

    async fn delete_template(
        &self,
        _ctx: &TtrpcContext,
        req: DeleteTemplateRequest,
    ) -> ttrpc::Result<DeleteTemplateResponse> {
        non_empty("name", &req.name)?;
        Services::delete_template(self, &req.name).await?;
        Ok(DeleteTemplateResponse::default())
    }

    async fn get_store_usage(
        &self,
        _ctx: &TtrpcContext,
        _req: GetStoreUsageRequest,
    ) -> ttrpc::Result<GetStoreUsageResponse> {
        Ok(Services::store_usage(self).await?)
    }

    async fn collect_garbage(
        &self,
        _ctx: &TtrpcContext,
        req: CollectGarbageRequest,
    ) -> ttrpc::Result<CollectGarbageResponse> {
        let grace = std::time::Duration::from_secs(req.grace_seconds);
        let c = Services::collect_garbage(self, &req.referenced, grace).await?;
        Ok(CollectGarbageResponse {
            deleted: c.deleted,
            reclaimed_bytes: c.reclaimed_bytes,
            ..Default::default()
        })
    }

    async fn retain_snapshot(
        &self,
        _ctx: &TtrpcContext,
        req: RetainSnapshotRequest,
    ) -> ttrpc::Result<RetainSnapshotResponse> {
        Services::retain_snapshot(self, &req.snapshot_id).await?;
        Ok(RetainSnapshotResponse::default())
    }
}

#[async_trait::async_trait]
impl twig_proto::node_ttrpc_async::Pool for Services {
    async fn acquire_vm(
        &self,
        _ctx: &TtrpcContext,
        req: AcquireVmRequest,
    ) -> ttrpc::Result<AcquireVmResponse> {
        self.acquire(&req).await.map_err(|e| {
            tracing::warn!(
                sandbox = req.sandbox_id,
                template = req.template,
                "AcquireVm: {e}"
            );
            e.into()
        })
    }

    async fn acquire_net_set(
        &self,
        _ctx: &TtrpcContext,
        req: AcquireNetSetRequest,
    ) -> ttrpc::Result<AcquireNetSetResponse> {
        let Some(net) = self.net.clone() else {
            return Ok(AcquireNetSetResponse::default());
        };
        let dir = PathBuf::from(&req.dir);
        let sandbox = req.sandbox_id.clone();
        let taken = blocking(move || net.take(&dir, &sandbox))
            .await
            .map_err(|e| {
                tracing::warn!(
                    sandbox = req.sandbox_id,
                    dir = req.dir,
                    "AcquireNetSet: {e}"
                );
                ttrpc::Error::from(e)
            })?;
        Ok(AcquireNetSetResponse {
            taken,
            ..Default::default()
        })
    }

    async fn status(
        &self,
        _ctx: &TtrpcContext,
        _req: StatusRequest,
    ) -> ttrpc::Result<StatusResponse> {
        let pool = self
            .pool
            .levels()
            .into_iter()
            .map(|l| PoolLevel {
                memory_mib: l.shape.mem_mib,
                vcpus: l.shape.vcpus,
                disk_slots: l.shape.disk_slots,
                target: u32::try_from(l.target).unwrap_or(u32::MAX),
                ready_pids: l.ready,
                starting: u32::try_from(l.starting).unwrap_or(u32::MAX),
                ..Default::default()
            })
            .collect();
        Ok(StatusResponse {
            pool,
            handed_pids: self.pool.handed(),
            net_sets_ready: self
                .net
                .as_ref()
                .map_or(0, |n| u32::try_from(n.ready()).unwrap_or(u32::MAX)),
            shapes: {
                let default = self.templates.default_shape();
                self.templates
                    .offered()
                    .into_iter()
                    .map(|s| BaseShape {
                        memory_mib: s.mem_mib,
                        vcpus: s.vcpus,
                        is_default: s == default,
                        ..Default::default()
                    })
                    .collect()
            },
            guest_reserve_mib: self.templates.guest_reserve_mib(),
            ..Default::default()
        })
    }
}

/// A running daemon: the pool and the ttrpc server on its socket.
pub struct Daemon {
    server: ttrpc::r#async::Server,
    pool: Pool,
    builder: Arc<Builder>,
    net: Option<Arc<NetPool>>,
    socket: PathBuf,
}

impl Daemon {
    /// Opens the store, starts the pool and serves both services on
    /// `config.socket` (a stale socket file nobody answers on is replaced;
    /// one a live daemon serves is an error).
    pub async fn start(config: &Config) -> Result<Daemon> {
        let templates = Arc::new(Templates::open(config)?);
        if let Some(parent) = config.socket.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        }
        if config.socket.exists() {
            if std::os::unix::net::UnixStream::connect(&config.socket).is_ok() {
                return Err(Error::FailedPrecondition(format!(
                    "{} is served already: another twig-node runs",
                    config.socket.display()
                )));
            }
            std::fs::remove_file(&config.socket).map_err(|e| {
                Error::io(format!("removing the stale {}", config.socket.display()), e)
            })?;
        }
        let pool = Pool::start(config)?;
        let builder = Builder::new(config.templates.clone(), templates.clone());
        let net = NetPool::start(&config.net_pool)?.map(Arc::new);
        let registry = Arc::new(Registry::new(&config.registry, &config.run_dir)?);
        let services = Arc::new(Services::new(
            templates,
            pool.clone(),
            builder.clone(),
            net.clone(),
            registry,
        ));
        let mut server = ttrpc::r#async::Server::new()
            .bind(&format!("unix://{}", config.socket.display()))
            .map_err(|e| Error::Internal(format!("binding {}: {e}", config.socket.display())))?
            .register_service(twig_proto::twig_ttrpc::create_node(services.clone()))
            .register_service(twig_proto::node_ttrpc_async::create_pool(services));
        server
            .start()
            .await
            .map_err(|e| Error::Internal(format!("serving {}: {e}", config.socket.display())))?;
        tracing::info!(socket = %config.socket.display(), "twig-node serving");
        Ok(Daemon {
            server,
            pool,
            builder,
            net,
            socket: config.socket.clone(),
        })
    }

    /// The pool (status, tests).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Kills the pooled VMMs (handed-over ones run on), removes the pooled
    /// twig-net sets (handed-over ones are their shims'), stops serving and
    /// removes the socket. Connected clients get [`STOP_GRACE`] to let go
    /// (ttrpc waits for every connection otherwise; an idle client holding
    /// its connection would delay the stop by ttrpc's own 10 s).
    pub async fn stop(mut self) {
        self.builder.stop();
        self.pool.close();
        if let Some(net) = self.net.take() {
            if let Err(e) = tokio::task::spawn_blocking(move || net.close()).await {
                tracing::warn!("closing the twig-net pool: {e}");
            }
        }
        self.pool.closed(STOP_GRACE).await;
        match tokio::time::timeout(STOP_GRACE, self.server.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("stopping the ttrpc server: {e}"),
            Err(_) => {
                tracing::info!("clients still connected after {STOP_GRACE:?}; stopping anyway")
            }
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// How long a stopping daemon waits for its clients' connections to close.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_millis(500);
