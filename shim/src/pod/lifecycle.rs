//! A container's life in the pod: create (the pod's first container makes
//! the VM; a container of the snapshot a VM was restored from is adopted
//! instead of created), start (its output and stdin wired to the agent, its
//! exit watched), exec, kill and delete.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use containerd_shim_protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskIO, TaskStart,
};
use containerd_shim_protos::protobuf::MessageField;
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc;
use tokio::sync::oneshot;
use twig_agent::client::Stream;

use super::guest_spec::{guest_spec, join_pid_namespace_of, joins_pid_namespace};
use super::process::{timestamp, Container, Exited, Origin, Phase, Proc};
use super::{blocking, shim_pid, NewContainer, Pod, AGENT_WAIT};
use crate::error::{Error, Result};
use crate::resources::block;
use crate::resources::rootfs::{rootfs_image, slot_device};
use crate::resources::volumes::{self, PodDisk, Volume};
use crate::sandbox::{with_agent, Attachment, Sandbox, SANDBOX_ADOPTION};
use crate::spec::{
    self, CONTAINER_NAME_ANNOTATION, CONTAINER_TYPE_ANNOTATION, CONTAINER_TYPE_SANDBOX,
};
use crate::stdio::{self, StdioPaths};

impl Pod {
    /// Creates container `new.id` from its bundle: the pod's first
    /// container makes the pod's VM; a running container of the snapshot
    /// the VM was restored from with the same CRI name (the new sandbox
    /// container: the snapshotted one) is adopted; any other is created in
    /// the VM, on a disk slot (the sandbox container: the agent's pause).
    pub async fn create(&self, new: NewContainer) -> Result<()> {
        let mut timer = CallTimer::new();
        let _membership = self.changing_containers().await;
        if self.containers().contains_key(&new.id) {
            return Err(Error::AlreadyExists(format!(
                "container {} already exists",
                new.id
            )));
        }
        let bundle = PathBuf::from(&new.bundle);
        let mut oci = spec::read_spec(&bundle)?;
        let image = rootfs_image(&new.id, &new.rootfs)?;
        let root_read_only = spec::root_read_only(&oci);
        let name = spec::annotation(&oci, CONTAINER_NAME_ANNOTATION).map(str::to_string);
        let is_sandbox =
            spec::annotation(&oci, CONTAINER_TYPE_ANNOTATION) == Some(CONTAINER_TYPE_SANDBOX);
        // The sandbox container (the agent's pause) takes no devices.
        let blocks = if is_sandbox {
            Vec::new()
        } else {
            block::take_volumes(&mut oci, Path::new("/sys/dev/block"), Path::new("/dev"))?
        };
        let paths = new.stdio.clone();
        let opened = paths.open().await?;
        let sandbox = {
            let mut slot = self.inner.sandbox.lock().await;
            match slot.as_ref() {
                Some(s) => s.clone(),
                None => {
                    let group = spec::grouping(&new.id, &oci);
                    let launcher = self.inner.launcher.clone();
                    let (b, rootfs) = (bundle.clone(), image.clone());
                    let s = timer
                        .vm(blocking(move || launcher.launch(&group, &b, &rootfs)))
                        .await?;
                    if let Some(death) = s.death() {
                        self.watch_vm(death);
                    }
                    *slot = Some(s.clone());
                    s
                }
            }
        };
        let sandbox_init = self.sandbox_pid();
        let target = if is_sandbox {
            None
        } else {
            self.pid_target(&new.id, &oci)?
        };
        // Guest volumes are named after the container's name; one that
        // adopts a process whose mounts bind volumes of another name (an
        // app template's build container's, and after it every clone's)
        // takes those names, so that this pod's content (its resolv.conf,
        // hosts, tokens) is what the adopted process sees.
        let mounts_of = name
            .as_deref()
            .filter(|_| !is_sandbox)
            .and_then(|n| sandbox.restored_for(n))
            .and_then(|r| r.mounts_of);
        let (mut guest, plan) = guest_spec(
            oci,
            sandbox_init,
            mounts_of
                .as_deref()
                .unwrap_or(name.as_deref().unwrap_or(&new.id)),
        )?;
        if let Some(pid) = target {
            join_pid_namespace_of(&mut guest, pid);
        }
        let spec_json = serde_json::to_vec(&guest)
            .map_err(|e| Error::Internal(format!("encoding the OCI spec: {e}")))?;
        // A read-only root (`readOnlyRootFilesystem`) is made read-only by
        // the agent once the container's mounts are made, as runc does:
        // a mount point the image lacks (`/etc/hostname`, a volume's
        // directory) is created first, so the disk is attached writable
        // whenever the spec binds anything.
        let read_only = root_read_only && plan.volumes.is_empty();
        // The guest volumes its mounts bind, with their content now (an
        // adopted container's too: a clone's own token replaces its
        // source's), then kept current while it lives.
        let shares = plan.volumes.iter().find(|v| matches!(v, Volume::Shared(_)));
        let mut share_servers = Vec::new();
        if !plan.volumes.is_empty() {
            let disk = if plan.volumes.iter().any(Volume::on_pod_disk) {
                Some(timer.vm(self.pod_disk(&sandbox)).await?)
            } else {
                None
            };
            let (sb, vols, timeout) = (sandbox.clone(), plan.volumes.clone(), self.inner.timeout);
            share_servers = timer
                .vm(blocking(move || {
                    volumes::prepare(sb.as_ref(), &vols, disk.as_ref(), timeout)
                }))
                .await?;
            self.watch_volumes(&new.id, &sandbox, &plan.volumes)?;
        }
        // A container of the pod snapshot the VM was restored from runs
        // already: adopt it (its rootfs is the snapshot's copy on its slot);
        // the new sandbox container adopts the snapshotted one, whose
        // namespaces the adopted containers share.
        let adoption = if is_sandbox {
            Some(SANDBOX_ADOPTION)
        } else {
            name.as_deref()
        };
        // A restored container runs already: a raw block volume or a host
        // directory cannot be added to it. Refused before it is taken, so
        // it stays adoptable.
        let host_volume = match (blocks.first(), shares) {
            (Some(b), _) => Some(format!("a raw block volume ({})", b.path)),
            (None, Some(Volume::Shared(s))) => {
                Some(format!("a host directory ({})", s.serve.dir.display()))
            }
            _ => None,
        };
        if let (Some(n), Some(what)) = (adoption, host_volume) {
            if sandbox.restored_for(n).is_some() {
                self.inner.watcher.unwatch(&new.id);
                return Err(Error::FailedPrecondition(format!(
                    "container {} runs already in the VM restored from a snapshot: {what} \
                     cannot be added to it",
                    new.id
                )));
            }
        }
        let adopted = adoption.and_then(|n| sandbox.take_restored(n));
        let disk_image = is_sandbox.then(|| image.clone());
        let (attachment, origin, guest_id, block_attachments) = match adopted {
            Some(r) => {
                tracing::info!(
                    id = new.id,
                    guest_id = r.guest_id,
                    name,
                    is_sandbox,
                    "adopting a restored container"
                );
                if is_sandbox {
                    if let Some(pid) = r.pid {
                        self.inner
                            .sandbox_init
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(pid);
                    }
                }
                let attachment = Attachment {
                    device: r.slot.map(slot_device).transpose()?.unwrap_or_default(),
                    slot: r.slot,
                };
                (attachment, Origin::Adopted, r.guest_id, Vec::new())
            }
            None => {
                let id = new.id.clone();
                let sb = sandbox.clone();
                let timeout = self.inner.timeout;
                // The pod's sandbox container needs no disk: its init is
                // the agent's built-in pause.
                let created = timer
                    .vm(blocking(move || {
                        if is_sandbox {
                            return sb
                                .create_pause(&id, &spec_json, timeout)
                                .map(|a| (a, Vec::new()));
                        }
                        let (attached, requests) = block::attach(sb.as_ref(), &blocks)?;
                        sb.create_container(&id, &image, read_only, requests, &spec_json)
                            .map(|a| (a, attached.clone()))
                            .inspect_err(|_| block::detach(sb.as_ref(), &attached))
                    }))
                    .await;
                let (attachment, blocks) =
                    created.inspect_err(|_| self.inner.watcher.unwatch(&new.id))?;
                (attachment, Origin::Created, new.id.clone(), blocks)
            }
        };
        let container = Container {
            id: new.id.clone(),
            guest_id,
            mounts_of,
            bundle,
            origin,
            attachment,
            block_volumes: block_attachments,
            shares: share_servers,
            volumes: plan.volumes,
            disk_image,
            init: Proc::new("", paths, opened, Vec::new()),
            execs: HashMap::new(),
        };
        self.containers().insert(new.id.clone(), container);
        self.publish(
            topics::TASK_CREATE_EVENT_TOPIC,
            Box::new(TaskCreate {
                container_id: new.id.clone(),
                bundle: new.bundle.clone(),
                rootfs: new.rootfs.clone(),
                io: MessageField::some(TaskIO {
                    stdin: new.stdio.stdin.clone(),
                    stdout: new.stdio.stdout.clone(),
                    stderr: new.stdio.stderr.clone(),
                    terminal: new.stdio.terminal,
                    ..Default::default()
                }),
                pid: shim_pid(),
                ..Default::default()
            }),
        );
        timer.log("create", &new.id, "");
        Ok(())
    }

    /// Starts process `exec_id` of container `id` (empty: its init; an
    /// adopted container's init runs already), wires its output and stdin
    /// through the agent, and watches for its exit.
    pub async fn start(&self, id: &str, exec_id: &str) -> Result<()> {
        let mut timer = CallTimer::new();
        let (opened, terminal, process_json) = self.with_proc(id, exec_id, |p| {
            if p.phase != Phase::Created {
                return Err(Error::FailedPrecondition(format!(
                    "process {id}/{exec_id} was already started"
                )));
            }
            Ok((
                p.opened.take().unwrap_or_default(),
                p.stdio.terminal,
                p.process_json.clone(),
            ))
        })?;
        let sandbox = self.sandbox().await?;
        let (guest_id, adopted) = self.guest_id(id)?;
        // An adopted container's init runs already.
        let adopted_init = adopted && exec_id.is_empty();
        let (gid, eid) = (guest_id.clone(), exec_id.to_string());
        let sb = sandbox.clone();
        let timeout = self.inner.timeout;
        let started = timer
            .vm(blocking(move || {
                if adopted_init {
                    Ok(0)
                } else if eid.is_empty() {
                    sb.agent()
                        .start_container(&gid, timeout)
                        .map_err(|e| Error::agent(format!("starting container {gid}"), e))
                } else {
                    sb.agent()
                        .exec_process(&gid, &eid, &process_json, timeout)
                        .map_err(|e| Error::agent(format!("starting exec {eid} in {gid}"), e))
                }
            }))
            .await;
        let guest_pid = match started {
            Ok(pid) => pid,
            Err(e) => {
                // Nothing runs: the process stays created, its stdio closed.
                return Err(e);
            }
        };
        if exec_id.is_empty() && !adopted_init {
            let mut init = self
                .inner
                .sandbox_init
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            init.get_or_insert(guest_pid);
        }
        let mut copiers = Vec::new();
        let streams = [
            (Stream::Stdout, opened.stdout),
            (Stream::Stderr, opened.stderr),
        ];
        for (stream, out) in streams {
            let Some(out) = out else { continue };
            let (sb, id, e) = (sandbox.clone(), guest_id.clone(), exec_id.to_string());
            let read: stdio::ReadFn = Arc::new(move || {
                with_agent(sb.as_ref(), |a| {
                    a.read_stream(&id, &e, stream, stdio::CHUNK, AGENT_WAIT)
                })
                .map_err(|err| Error::agent(format!("reading {stream:?} of {id}/{e}"), err))
            });
            copiers.push(stdio::copy_out(read, out));
        }
        let (close_tx, stdin_copier) = match opened.stdin {
            Some(fifo) => {
                let (tx, rx) = oneshot::channel();
                let (sb, id, e) = (sandbox.clone(), guest_id.clone(), exec_id.to_string());
                let write: stdio::WriteFn = Arc::new(move |d: &[u8]| {
                    with_agent(sb.as_ref(), |a| a.write_stdin(&id, &e, d, timeout))
                        .map_err(|err| Error::agent(format!("writing stdin of {id}/{e}"), err))
                });
                let (sb, id, e) = (sandbox.clone(), guest_id.clone(), exec_id.to_string());
                let close: stdio::CloseFn = Arc::new(move || {
                    with_agent(sb.as_ref(), |a| a.close_stdin(&id, &e, timeout))
                        .map_err(|err| Error::agent(format!("closing stdin of {id}/{e}"), err))
                });
                (Some(tx), Some(stdio::copy_in(fifo, rx, write, close)))
            }
            None => {
                if !terminal && !adopted_init {
                    // No stdin: the process reads end of file, as under runc.
                    let (sb, id, e) = (sandbox.clone(), guest_id.clone(), exec_id.to_string());
                    if let Err(err) = timer
                        .vm(blocking(move || {
                            sb.agent()
                                .close_stdin(&id, &e, timeout)
                                .map_err(|err| Error::agent("closing stdin", err))
                        }))
                        .await
                    {
                        tracing::debug!("closing an unused stdin: {err}");
                    }
                }
                (None, None)
            }
        };
        self.with_proc(id, exec_id, |p| {
            p.phase = Phase::Running;
            p.guest_pid = guest_pid;
            p.close_stdin = close_tx;
            p.stdin_copier = stdin_copier;
            Ok(())
        })?;
        self.watch_exit(
            sandbox,
            guest_id,
            id.to_string(),
            exec_id.to_string(),
            copiers,
        );
        if exec_id.is_empty() {
            self.publish(
                topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart {
                    container_id: id.to_string(),
                    pid: shim_pid(),
                    ..Default::default()
                }),
            );
        } else {
            self.publish(
                topics::TASK_EXEC_STARTED_EVENT_TOPIC,
                Box::new(TaskExecStarted {
                    container_id: id.to_string(),
                    exec_id: exec_id.to_string(),
                    pid: shim_pid(),
                    ..Default::default()
                }),
            );
        }
        timer.log("start", id, exec_id);
        Ok(())
    }

    /// Deletes process `exec_id` of container `id` (an exec, which the
    /// agent then forgets), or with an empty `exec_id` the container (from
    /// the VM, and its rootfs disk detached); its exit (none yet: status 0,
    /// now).
    pub async fn delete(&self, id: &str, exec_id: &str) -> Result<Exited> {
        if !exec_id.is_empty() {
            let exited = {
                let mut containers = self.containers();
                let c = containers
                    .get_mut(id)
                    .ok_or_else(|| Error::NotFound(format!("container {id} not found")))?;
                let p = c
                    .execs
                    .get(exec_id)
                    .ok_or_else(|| Error::NotFound(format!("exec {exec_id} of {id} not found")))?;
                if p.phase == Phase::Running {
                    return Err(Error::FailedPrecondition(format!(
                        "exec {exec_id} of {id} is running"
                    )));
                }
                let exited = p.exited();
                c.execs.remove(exec_id);
                exited
            };
            self.forget_exec(id, exec_id).await;
            return Ok(or_now(exited));
        }
        let _membership = self.changing_containers().await;
        let (exited, attachment, vols, blocks) = {
            let containers = self.containers();
            let c = containers
                .get(id)
                .ok_or_else(|| Error::NotFound(format!("container {id} not found")))?;
            if c.init.phase == Phase::Running {
                return Err(Error::FailedPrecondition(format!(
                    "container {id} is running; kill it first"
                )));
            }
            // A guest volume another container of the pod binds too stays:
            // kubelet starts a restarted container (the same name, so the
            // same volumes) before it removes the exited one.
            let others: HashSet<&str> = containers
                .values()
                .filter(|o| o.id != id)
                .flat_map(|o| o.volumes.iter().map(Volume::name))
                .collect();
            let own: Vec<Volume> = c
                .volumes
                .iter()
                .filter(|v| !others.contains(v.name()))
                .cloned()
                .collect();
            (
                c.init.exited(),
                c.attachment.clone(),
                own,
                c.block_volumes.clone(),
            )
        };
        self.inner.watcher.unwatch(id);
        let sandbox = self.sandbox().await?;
        let (guest, timeout) = (self.guest_id(id)?.0, self.inner.timeout);
        // A dead VM took the container and its disk slot with it.
        let dead = *self.inner.vm_dead.borrow();
        blocking(move || {
            let id = guest;
            if dead {
                return Ok(());
            }
            match sandbox.agent().remove_container(&id, timeout) {
                Ok(()) => {}
                Err(e) if e.status_code() == Some("NOT_FOUND") => {}
                // No answer at all (the connection is gone: the VM died).
                // The container went with it; refusing would leave
                // containerd retrying a delete that can never succeed.
                Err(e) if e.status_code().is_none() => {
                    tracing::warn!(
                        id,
                        "the agent does not answer ({e}); the container is gone with the VM"
                    );
                    return Ok(());
                }
                Err(e) => return Err(Error::agent(format!("removing container {id}"), e)),
            }
            // Its own guest volumes go with it (a crash loop leaks none).
            if let Err(e) = volumes::remove(&sandbox.agent(), &vols, timeout) {
                tracing::warn!(id, "{e}");
            }
            block::detach(sandbox.as_ref(), &blocks);
            sandbox.detach(&attachment)
        })
        .await?;
        self.containers().remove(id);
        let exited = or_now(exited);
        self.publish(
            topics::TASK_DELETE_EVENT_TOPIC,
            Box::new(TaskDelete {
                container_id: id.to_string(),
                id: id.to_string(),
                pid: shim_pid(),
                exit_status: exited.status,
                exited_at: timestamp(exited.at),
                ..Default::default()
            }),
        );
        Ok(exited)
    }

    /// Sends `signal` to process `exec_id` of container `id`. A process not
    /// started yet exits at once (128 + `signal`, as under runc); a KILL the
    /// guest does not take kills the pod's VM.
    pub async fn kill(&self, id: &str, exec_id: &str, signal: u32) -> Result<()> {
        let phase = self.with_proc(id, exec_id, |p| Ok(p.phase))?;
        match phase {
            Phase::Stopped => {
                return Err(Error::NotFound(format!(
                    "process {id}/{exec_id}: process already finished"
                )))
            }
            Phase::Created => {
                // Nothing runs in the guest yet: as with runc, the signal
                // ends the process (exit status 128 + signal), so a client
                // that kills then waits (containerd's WithProcessKill, when
                // a CRI start failed) sees it exit and can delete it.
                let exited = Exited {
                    status: 128 + signal,
                    at: SystemTime::now(),
                };
                self.record_exit(id, exec_id, exited);
                return Ok(());
            }
            Phase::Running => {}
        }
        let sandbox = self.sandbox().await?;
        let timeout = self.inner.timeout;
        let sb = sandbox.clone();
        let guest_id = self.guest_id(id)?.0;
        let (id, exec_id) = (id.to_string(), exec_id.to_string());
        let sent = blocking(move || {
            sb.agent()
                .signal_process(&guest_id, &exec_id, signal, timeout)
                .map_err(|e| Error::agent(format!("signal {signal} to {id}/{exec_id}"), e))
        })
        .await;
        match sent {
            // A KILL the guest does not take (it stopped answering, or its
            // VM is gone) ends the pod: the shim kills the VM, and the death
            // watch reports every process exited.
            Err(e)
                if signal == libc::SIGKILL as u32
                    && matches!(
                        e.code(),
                        ttrpc::Code::DEADLINE_EXCEEDED | ttrpc::Code::INTERNAL
                    ) =>
            {
                tracing::error!("{e}: killing the pod's VM");
                if let Err(k) = blocking(move || sandbox.kill()).await {
                    tracing::warn!("killing the VM: {k}");
                }
                if self.vm_died_within(timeout).await {
                    Ok(())
                } else {
                    Err(e)
                }
            }
            other => other,
        }
    }

    /// Adds exec `exec_id` (its OCI process `process_json`, checked JSON)
    /// to running container `id`; Start runs it.
    pub async fn exec(
        &self,
        id: &str,
        exec_id: &str,
        stdio: StdioPaths,
        process_json: Vec<u8>,
    ) -> Result<()> {
        {
            let containers = self.containers();
            let c = containers
                .get(id)
                .ok_or_else(|| Error::NotFound(format!("container {id} not found")))?;
            if c.execs.contains_key(exec_id) {
                return Err(Error::AlreadyExists(format!(
                    "exec {exec_id} already exists in {id}"
                )));
            }
            if c.init.phase != Phase::Running {
                return Err(Error::FailedPrecondition(format!(
                    "container {id} is not running"
                )));
            }
        }
        let opened = stdio.open().await?;
        {
            let mut containers = self.containers();
            let c = containers
                .get_mut(id)
                .ok_or_else(|| Error::NotFound(format!("container {id} not found")))?;
            if c.execs.contains_key(exec_id) {
                return Err(Error::AlreadyExists(format!(
                    "exec {exec_id} already exists in {id}"
                )));
            }
            c.execs.insert(
                exec_id.to_string(),
                Proc::new(exec_id, stdio, opened, process_json),
            );
        }
        self.publish(
            topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Box::new(TaskExecAdded {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
                ..Default::default()
            }),
        );
        Ok(())
    }
}

impl Pod {
    /// The guest pid whose pid namespace new container `id` joins instead
    /// of the pod's, if any. The pod's first container after the sandbox's
    /// says whether its containers share the pod's pid namespace (CRI's POD
    /// mode: every container's spec names it) or have their own
    /// (CONTAINER mode). A later container naming a pid namespace in a pod
    /// of the second kind is kubelet's ephemeral container with a target
    /// (`kubectl debug --target`): every twig task reports the shim's pid,
    /// so the path CRI builds from the target's pid cannot say which
    /// container it is. With one running container the target is that one;
    /// with several the create is refused rather than joining another
    /// namespace than asked.
    fn pid_target(&self, id: &str, oci: &serde_json::Value) -> Result<Option<u32>> {
        let joins = joins_pid_namespace(oci);
        let shares = {
            let mut shares = self
                .inner
                .shares_pids
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            *shares.get_or_insert(joins)
        };
        if shares || !joins {
            return Ok(None);
        }
        let sandbox_init = self.sandbox_pid();
        let running: Vec<(String, u32)> = self
            .containers()
            .values()
            .filter(|c| c.init.phase == Phase::Running && Some(c.init.guest_pid) != sandbox_init)
            .map(|c| (c.id.clone(), c.init.guest_pid))
            .collect();
        match running.as_slice() {
            [(_, pid)] if *pid > 0 => Ok(Some(*pid)),
            [(target, _)] => Err(Error::FailedPrecondition(format!(
                "container {id} joins the process namespace of container {target}, whose \
                 process in the VM is not known (adopted from a snapshot)"
            ))),
            [] => Err(Error::FailedPrecondition(format!(
                "container {id} joins another container's process namespace (kubectl debug \
                 --target), but no container of the pod runs"
            ))),
            many => Err(Error::InvalidArgument(format!(
                "container {id} joins another container's process namespace \
                 (ephemeralContainers[].targetContainerName, kubectl debug --target) in a pod \
                 of {} running containers: the twig runtime reports one pid for every \
                 container, so it cannot tell which one is the target; use \
                 shareProcessNamespace, or debug a pod with one container",
                many.len()
            ))),
        }
    }

    /// The pod's disk, attached on the first call: its sandbox container's
    /// rootfs image, which holds the pod's disk-backed volumes (snapshots,
    /// rollbacks and clones carry it as they carry every container's disk;
    /// a pod restored with one has it attached already).
    async fn pod_disk(&self, sandbox: &Arc<dyn Sandbox>) -> Result<PodDisk> {
        let _one_at_a_time = self.inner.pod_disk.lock().await;
        let found = self.containers().values().find_map(|c| {
            c.disk_image
                .clone()
                .map(|image| (c.id.clone(), image, c.attachment.clone()))
        });
        let Some((id, image, attachment)) = found else {
            return Err(Error::FailedPrecondition(
                "a disk-backed emptyDir lives on the pod's disk, its sandbox container's \
                 rootfs, and this pod has no sandbox container"
                    .into(),
            ));
        };
        if !attachment.device.is_empty() {
            return Ok(PodDisk {
                device: attachment.device,
                bytes: 0,
            });
        }
        let bytes = std::fs::metadata(&image)
            .map_err(|e| Error::io(format!("reading the size of {}", image.display()), e))?
            .len();
        let sb = sandbox.clone();
        let attachment = blocking(move || sb.attach_disk(&image, false)).await?;
        tracing::info!(
            sandbox = id,
            device = attachment.device,
            "the pod's disk attached"
        );
        let kept = match self.containers().get_mut(&id) {
            Some(c) => {
                c.attachment = attachment.clone();
                true
            }
            None => false,
        };
        if !kept {
            let (sb, a) = (sandbox.clone(), attachment);
            if let Err(e) = blocking(move || sb.detach(&a)).await {
                tracing::warn!(sandbox = id, "detaching the pod's disk: {e}");
            }
            return Err(Error::NotFound(format!(
                "the pod's sandbox container {id} was deleted"
            )));
        }
        Ok(PodDisk {
            device: attachment.device,
            bytes,
        })
    }

    /// Watches container `id`'s live configuration volumes: each settled
    /// change on the host is synced into the guest.
    fn watch_volumes(&self, id: &str, sandbox: &Arc<dyn Sandbox>, vols: &[Volume]) -> Result<()> {
        for v in vols {
            let Volume::Mirror(m) = v else { continue };
            if !m.live {
                continue;
            }
            let (sb, mirror, timeout) = (sandbox.clone(), m.clone(), self.inner.timeout);
            self.inner.watcher.watch(
                id,
                m.host.clone(),
                Arc::new(move || volumes::resync(&sb.agent(), &mirror, timeout)),
            )?;
        }
        Ok(())
    }

    /// Gives every mirrored volume of the pod its host content again, after
    /// a rollback took the guest's copies back to the snapshot's (a token
    /// rotated since, a ConfigMap edited): the pod keeps its current
    /// configuration and Secrets. A volume that cannot be synced is logged.
    pub async fn resync_volumes(&self) {
        let Ok(sandbox) = self.sandbox().await else {
            return;
        };
        let mirrors: Vec<volumes::Mirror> = self
            .containers()
            .values()
            .flat_map(|c| c.volumes.iter())
            .filter_map(|v| match v {
                Volume::Mirror(m) => Some(m.clone()),
                _ => None,
            })
            .collect();
        let timeout = self.inner.timeout;
        let synced = blocking(move || {
            for m in &mirrors {
                if let Err(e) = volumes::resync(&sandbox.agent(), m, timeout) {
                    tracing::warn!(volume = m.name, "after the rollback: {e}");
                }
            }
            Ok(())
        })
        .await;
        if let Err(e) = synced {
            tracing::warn!("after the rollback: {e}");
        }
    }
}

fn or_now(exited: Option<Exited>) -> Exited {
    Exited {
        status: exited.map(|e| e.status).unwrap_or_default(),
        at: exited.map(|e| e.at).unwrap_or_else(SystemTime::now),
    }
}

/// Where a Task call's time went: waiting on the VM (the VMM process
/// restoring it, the guest's agent) or in the shim itself. Logged at the
/// end of a successful Create or Start as a `timing` line (`own_us`,
/// `vm_us`), which `twig-bench cri` reads from containerd's log.
struct CallTimer {
    start: Instant,
    vm: Duration,
}

impl CallTimer {
    fn new() -> CallTimer {
        CallTimer {
            start: Instant::now(),
            vm: Duration::ZERO,
        }
    }

    /// Awaits `f`, a call into the VM, counting its time as the VM's.
    async fn vm<T>(&mut self, f: impl Future<Output = T>) -> T {
        let t = Instant::now();
        let out = f.await;
        self.vm += t.elapsed();
        out
    }

    fn log(&self, call: &str, id: &str, exec_id: &str) {
        let total = self.start.elapsed();
        tracing::info!(
            call,
            id,
            exec_id,
            own_us = total.saturating_sub(self.vm).as_micros() as u64,
            vm_us = self.vm.as_micros() as u64,
            "timing"
        );
    }
}
