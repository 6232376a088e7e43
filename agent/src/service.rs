//! The ttrpc service: every rpc of twig-proto's `agent.proto`.

use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use oci_spec::runtime::LinuxResources;
use ttrpc::TtrpcContext;
use twig_agent::proto::agent::{
    ContainerRequest, CreateContainerRequest, Empty, EnvdPolicy, ExecProcessRequest, PingRequest,
    PingResponse, PrepareVolumeRequest, PrepareVolumesRequest, ProcessRequest, ReadStreamRequest,
    ReadStreamResponse, ReadVolumeFileRequest, ReadVolumeFileResponse, ReidentifyRequest,
    ReidentifyResponse, RemoveVolumeRequest, ResizeTtyRequest, SignalProcessRequest, StartResponse,
    StatsResponse, SyncVolumeRequest, UpdateContainerRequest, WaitProcessRequest,
    WaitProcessResponse, WriteStdinRequest, WriteStdinResponse,
};
use twig_agent::proto::agent_ttrpc::{create_agent, Agent};

use crate::cgroup::{Cgroup, Limits};
use crate::container::{mount_rootfs, unmount_rootfs, Container, Process, Registry, State};
use crate::devices::Node;
use crate::error::{AgentError, Result};
use crate::reaper::{lock, Reaper};
use crate::spec::{parse_process, parse_spec, validate_id};
use crate::stdio::{set_winsize, write_with_deadline, DEFAULT_READ_BYTES, MAX_READ_BYTES};
use crate::volumes::Volumes;

/// The longest a call waits (WaitProcess, ReadStdout, ReadStderr).
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// How long WriteStdin waits for the process to take the data.
pub const STDIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The agent's state behind the rpcs.
pub struct AgentService {
    reaper: Arc<Reaper>,
    containers: Arc<Registry>,
    /// The sandbox API of each running pod sandbox, by its container id.
    envd: std::sync::Mutex<std::collections::HashMap<String, crate::envd::Envd>>,
    /// envd may listen in the agent's own network namespace: as PID 1 in
    /// a VM (the pod's network is the VM's), not on a host (tests).
    envd_in_agent_net: bool,
    state_dir: PathBuf,
    volumes: Volumes,
    no_pivot_root: bool,
}

fn wait_of(timeout_ms: u32) -> Duration {
    Duration::from_millis(u64::from(timeout_ms)).min(MAX_WAIT)
}

/// Logs a failed call and turns it into a ttrpc status.
fn reply<T>(call: &str, r: Result<T>) -> ttrpc::Result<T> {
    r.map_err(|e| {
        tracing::warn!("{call}: {e}");
        e.into()
    })
}

/// How long a new disk may take to reach its size in the guest: Linux
/// handles the configuration-change interrupt of a hot-swapped disk slot on
/// a workqueue.
const CAPACITY_WAIT: Duration = Duration::from_secs(2);

/// Checks that `device` is a block device and, when `bytes` is not 0,
/// waits until it has that size in whole 512-byte sectors (a disk slot
/// attached a moment ago may still show its previous capacity, 0 or the
/// last disk's). Reads sysfs: no guest exit while it waits.
fn wait_for_capacity(device: &Path, bytes: u64) -> Result<u64> {
    let deadline = Instant::now() + CAPACITY_WAIT;
    let want = bytes / 512 * 512;
    loop {
        let meta = std::fs::metadata(device).map_err(|e| {
            AgentError::InvalidArgument(format!("disk device {}: {e}", device.display()))
        })?;
        if !meta.file_type().is_block_device() {
            return Err(AgentError::InvalidArgument(format!(
                "disk device {} is not a block device",
                device.display()
            )));
        }
        let rdev = meta.rdev();
        if bytes == 0 {
            return Ok(rdev);
        }
        let sysfs = format!(
            "/sys/dev/block/{}:{}/size",
            libc::major(rdev),
            libc::minor(rdev)
        );
        let sectors: u64 = std::fs::read_to_string(&sysfs)
            .map_err(|e| AgentError::sys(format!("reading {sysfs}"), e))?
            .trim()
            .parse()
            .map_err(|e| AgentError::Internal(format!("{sysfs}: {e}")))?;
        let have = sectors * 512;
        if have == want {
            return Ok(rdev);
        }
        if Instant::now() >= deadline {
            return Err(AgentError::InvalidArgument(format!(
                "disk device {} has {have} bytes, not its disk's {want}, after \
                 {CAPACITY_WAIT:?}: the guest did not see the disk attached",
                device.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl AgentService {
    /// A service keeping container state under `state_dir` and guest
    /// volumes under `volumes_dir`.
    pub fn new(
        reaper: Arc<Reaper>,
        state_dir: PathBuf,
        volumes_dir: PathBuf,
        no_pivot_root: bool,
        envd_in_agent_net: bool,
    ) -> Self {
        AgentService {
            reaper,
            containers: Arc::default(),
            envd: Default::default(),
            envd_in_agent_net,
            state_dir,
            volumes: Volumes::new(volumes_dir),
            no_pivot_root,
        }
    }

    fn process(&self, container_id: &str, exec_id: &str) -> Result<Arc<Process>> {
        let c = self.containers.get(container_id)?;
        let c = lock(&c);
        c.process(exec_id)
    }

    fn create(&self, req: &CreateContainerRequest) -> Result<()> {
        let id = req.container_id.as_str();
        validate_id("container", id)?;
        let spec = parse_spec(&req.oci_spec_json)?;
        let device = match (req.builtin_pause, req.rootfs_device.as_str()) {
            (true, "") => None,
            (true, d) => {
                return Err(AgentError::InvalidArgument(format!(
                    "builtin_pause takes no rootfs_device (got {d})"
                )))
            }
            (false, "") => {
                return Err(AgentError::InvalidArgument(
                    "rootfs_device is empty".to_string(),
                ))
            }
            (false, d) => {
                let device = Path::new(d);
                wait_for_capacity(device, req.rootfs_bytes)?;
                Some(device)
            }
        };
        if device.is_none() && !req.block_volumes.is_empty() {
            return Err(AgentError::InvalidArgument(
                "the pod's sandbox container takes no block volumes".to_string(),
            ));
        }
        let block_nodes = req
            .block_volumes
            .iter()
            .map(|v| {
                let rdev = wait_for_capacity(Path::new(&v.device), v.bytes)?;
                Node::block_volume(&v.path, rdev, v.mode, v.uid, v.gid)
                    .map_err(AgentError::InvalidArgument)
            })
            .collect::<Result<Vec<_>>>()?;
        self.containers.insert_new(id, || {
            let dir = self.state_dir.join("containers").join(id);
            let rootfs = dir.join("rootfs");
            let unmount = || {
                if device.is_some() {
                    let _ = unmount_rootfs(&rootfs);
                    let _ = std::fs::remove_dir(&rootfs);
                    let _ = std::fs::remove_dir(&dir);
                }
            };
            if let Some(device) = device {
                std::fs::create_dir_all(&rootfs)
                    .map_err(|e| AgentError::sys(format!("creating {}", rootfs.display()), e))?;
                if let Err(e) = mount_rootfs(device, &rootfs, req.rootfs_read_only) {
                    let _ = std::fs::remove_dir(&rootfs);
                    let _ = std::fs::remove_dir(&dir);
                    return Err(e);
                }
            }
            let limits = Limits::of(spec.linux().as_ref().and_then(|l| l.resources().as_ref()));
            let cgroup = match Cgroup::create(id, limits) {
                Ok(c) => c.map(Arc::new),
                Err(e) => {
                    unmount();
                    return Err(e);
                }
            };
            tracing::info!(id, device = ?device, pause = device.is_none(), "container created");
            Ok(Container {
                cgroup,
                id: id.to_string(),
                rootfs,
                dir,
                spec,
                state: State::Created,
                execs: Default::default(),
                own_pid_ns: false,
                pause: device.is_none(),
                block_nodes,
                start_order: 0,
            })
        })
    }

    fn signal(&self, req: &SignalProcessRequest) -> Result<()> {
        let p = self.process(&req.container_id, &req.exec_id)?;
        let sig = i32::try_from(req.signal)
            .ok()
            .and_then(|s| Signal::try_from(s).ok())
            .ok_or_else(|| AgentError::InvalidArgument(format!("invalid signal {}", req.signal)))?;
        // As runc's shim answers: not found, which containerd takes as
        // done (a stop racing the process's own exit is no error).
        if let Some(exit) = p.exited() {
            return Err(AgentError::NotFound(format!(
                "process {} already finished (status {})",
                p.pid, exit.status
            )));
        }
        kill(Pid::from_raw(p.pid), sig)
            .map_err(|e| AgentError::sys(format!("sending {sig} to {}", p.pid), e))
    }

    fn write_stdin(&self, req: &WriteStdinRequest) -> Result<u32> {
        let p = self.process(&req.container_id, &req.exec_id)?;
        let stdin = lock(&p.stdin);
        let fd = stdin
            .as_ref()
            .ok_or_else(|| AgentError::FailedPrecondition("stdin is closed".to_string()))?;
        let n = write_with_deadline(fd.as_fd(), &req.data, STDIN_TIMEOUT)?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    fn close_stdin(&self, req: &ProcessRequest) -> Result<()> {
        let p = self.process(&req.container_id, &req.exec_id)?;
        let mut stdin = lock(&p.stdin);
        if p.tty.is_some() {
            // A terminal has no end of input to close: send VEOF (^D),
            // which ends a read on an empty line.
            if let Some(fd) = stdin.as_ref() {
                write_with_deadline(fd.as_fd(), &[4], STDIN_TIMEOUT)?;
            }
            return Ok(());
        }
        stdin.take();
        Ok(())
    }

    fn read(&self, req: &ReadStreamRequest, stderr: bool) -> Result<ReadStreamResponse> {
        let p = self.process(&req.container_id, &req.exec_id)?;
        let buf = if stderr { &p.stderr } else { &p.stdout };
        let max = match req.max_bytes as usize {
            0 => DEFAULT_READ_BYTES,
            n => n.min(MAX_READ_BYTES),
        };
        let (data, eof) = buf.read(max, wait_of(req.timeout_ms));
        Ok(ReadStreamResponse {
            data,
            eof,
            ..Default::default()
        })
    }

    fn resize(&self, req: &ResizeTtyRequest) -> Result<()> {
        let p = self.process(&req.container_id, &req.exec_id)?;
        let tty = p.tty.as_ref().ok_or_else(|| {
            AgentError::FailedPrecondition(format!("process {} has no terminal", p.pid))
        })?;
        let rows = u16::try_from(req.rows)
            .map_err(|_| AgentError::InvalidArgument(format!("rows {} too large", req.rows)))?;
        let cols = u16::try_from(req.cols)
            .map_err(|_| AgentError::InvalidArgument(format!("cols {} too large", req.cols)))?;
        set_winsize(tty.as_fd(), rows, cols)
    }

    fn remove(&self, id: &str) -> Result<()> {
        let c = self.containers.get(id)?;
        let mut c = lock(&c);
        c.remove()?;
        self.containers.remove(id);
        lock(&self.envd).remove(id);
        tracing::info!(id, "container removed");
        Ok(())
    }
}

impl Agent for AgentService {
    fn ping(&self, _ctx: &TtrpcContext, _: PingRequest) -> ttrpc::Result<PingResponse> {
        let uptime = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
            .map(|t| t.tv_sec() as f64 + t.tv_nsec() as f64 / 1e9)
            .unwrap_or_default();
        Ok(PingResponse {
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_s: uptime,
            ..Default::default()
        })
    }

    fn create_container(
        &self,
        _ctx: &TtrpcContext,
        req: CreateContainerRequest,
    ) -> ttrpc::Result<Empty> {
        reply("CreateContainer", self.create(&req).map(|()| Empty::new()))
    }

    fn start_container(
        &self,
        _ctx: &TtrpcContext,
        req: ContainerRequest,
    ) -> ttrpc::Result<StartResponse> {
        let r = self.containers.get(&req.container_id).and_then(|c| {
            let mut c = lock(&c);
            let envd = match c.pause {
                true => crate::envd::wanted(&c.spec).map_err(AgentError::InvalidArgument)?,
                false => None,
            };
            let pid = c.start(&self.reaper, self.no_pivot_root)?;
            if let Some(policy) = envd {
                self.start_envd(&c.id, pid, policy);
            }
            Ok(pid)
        });
        reply(
            "StartContainer",
            r.map(|pid| StartResponse {
                pid,
                ..Default::default()
            }),
        )
    }

    fn exec_process(
        &self,
        _ctx: &TtrpcContext,
        req: ExecProcessRequest,
    ) -> ttrpc::Result<StartResponse> {
        let r = validate_id("exec", &req.exec_id)
            .and_then(|()| parse_process(&req.oci_process_json))
            .and_then(|process| {
                let c = self.containers.get(&req.container_id)?;
                let mut c = lock(&c);
                c.exec(&self.reaper, &req.exec_id, process)
            });
        reply(
            "ExecProcess",
            r.map(|pid| StartResponse {
                pid,
                ..Default::default()
            }),
        )
    }

    fn signal_process(
        &self,
        _ctx: &TtrpcContext,
        req: SignalProcessRequest,
    ) -> ttrpc::Result<Empty> {
        reply("SignalProcess", self.signal(&req).map(|()| Empty::new()))
    }

    fn wait_process(
        &self,
        _ctx: &TtrpcContext,
        req: WaitProcessRequest,
    ) -> ttrpc::Result<WaitProcessResponse> {
        let r = self.process(&req.container_id, &req.exec_id).map(|p| {
            match p.exit.wait(wait_of(req.timeout_ms)) {
                Some(exit) => WaitProcessResponse {
                    exited: true,
                    exit_status: exit.status,
                    signal: exit.signal,
                    oom_killed: p.oom_killed(),
                    ..Default::default()
                },
                None => WaitProcessResponse::default(),
            }
        });
        reply("WaitProcess", r)
    }

    fn write_stdin(
        &self,
        _ctx: &TtrpcContext,
        req: WriteStdinRequest,
    ) -> ttrpc::Result<WriteStdinResponse> {
        reply(
            "WriteStdin",
            self.write_stdin(&req).map(|written| WriteStdinResponse {
                written,
                ..Default::default()
            }),
        )
    }

    fn close_stdin(&self, _ctx: &TtrpcContext, req: ProcessRequest) -> ttrpc::Result<Empty> {
        reply("CloseStdin", self.close_stdin(&req).map(|()| Empty::new()))
    }

    fn read_stdout(
        &self,
        _ctx: &TtrpcContext,
        req: ReadStreamRequest,
    ) -> ttrpc::Result<ReadStreamResponse> {
        reply("ReadStdout", self.read(&req, false))
    }

    fn read_stderr(
        &self,
        _ctx: &TtrpcContext,
        req: ReadStreamRequest,
    ) -> ttrpc::Result<ReadStreamResponse> {
        reply("ReadStderr", self.read(&req, true))
    }

    fn resize_tty(&self, _ctx: &TtrpcContext, req: ResizeTtyRequest) -> ttrpc::Result<Empty> {
        reply("ResizeTty", self.resize(&req).map(|()| Empty::new()))
    }

    fn remove_container(&self, _ctx: &TtrpcContext, req: ContainerRequest) -> ttrpc::Result<Empty> {
        reply(
            "RemoveContainer",
            self.remove(&req.container_id).map(|()| Empty::new()),
        )
    }

    fn remove_process(&self, _ctx: &TtrpcContext, req: ProcessRequest) -> ttrpc::Result<Empty> {
        let r = self
            .containers
            .get(&req.container_id)
            .and_then(|c| lock(&c).remove_exec(&req.exec_id));
        reply("RemoveProcess", r.map(|()| Empty::new()))
    }

    fn update_container(
        &self,
        _ctx: &TtrpcContext,
        req: UpdateContainerRequest,
    ) -> ttrpc::Result<Empty> {
        let r = serde_json::from_slice::<LinuxResources>(&req.resources_json)
            .map_err(|e| {
                AgentError::InvalidArgument(format!(
                    "container {:?}: resources are not an OCI linux.resources: {e}",
                    req.container_id
                ))
            })
            .and_then(|resources| {
                let c = self.containers.get(&req.container_id)?;
                let cgroup = lock(&c).cgroup.clone();
                let limits = Limits::of(Some(&resources));
                match cgroup {
                    Some(cg) => cg.update(&limits),
                    None if limits.any() => Err(AgentError::FailedPrecondition(format!(
                        "container {:?} has no cgroup (no cgroup v2 in this VM) to hold {limits:?}",
                        req.container_id
                    ))),
                    None => Ok(()),
                }
            });
        reply("UpdateContainer", r.map(|()| Empty::new()))
    }

    fn stats(&self, _ctx: &TtrpcContext, req: ContainerRequest) -> ttrpc::Result<StatsResponse> {
        let r = self.containers.get(&req.container_id).map(|c| {
            let (rss, user, system, count) = lock(&c).stats();
            StatsResponse {
                memory_rss_bytes: rss,
                cpu_user_us: user,
                cpu_system_us: system,
                process_count: count,
                ..Default::default()
            }
        });
        reply("Stats", r)
    }

    fn reidentify(
        &self,
        _ctx: &TtrpcContext,
        req: ReidentifyRequest,
    ) -> ttrpc::Result<ReidentifyResponse> {
        let r = crate::reidentify::apply(&req).and_then(|previous| {
            self.rename_containers(&req.hostname)?;
            if let Some(envd) = req.envd.as_ref() {
                self.set_envd(envd);
            }
            Ok(ReidentifyResponse {
                previous_realtime_ns: previous,
                ..Default::default()
            })
        });
        reply("Reidentify", r)
    }

    fn prepare_volume(
        &self,
        _ctx: &TtrpcContext,
        req: PrepareVolumeRequest,
    ) -> ttrpc::Result<Empty> {
        reply(
            "PrepareVolume",
            self.prepare_one(req).map(|()| Empty::new()),
        )
    }

    fn prepare_volumes(
        &self,
        _ctx: &TtrpcContext,
        req: PrepareVolumesRequest,
    ) -> ttrpc::Result<Empty> {
        let r = req.volumes.into_iter().try_for_each(|v| {
            let name = v.name.clone();
            self.prepare_one(v)
                .map_err(|e| e.context(&format!("volume {name}")))
        });
        reply("PrepareVolumes", r.map(|()| Empty::new()))
    }

    fn sync_volume(&self, _ctx: &TtrpcContext, req: SyncVolumeRequest) -> ttrpc::Result<Empty> {
        reply("SyncVolume", self.volumes.sync(req).map(|()| Empty::new()))
    }

    fn read_volume_file(
        &self,
        _ctx: &TtrpcContext,
        req: ReadVolumeFileRequest,
    ) -> ttrpc::Result<ReadVolumeFileResponse> {
        reply("ReadVolumeFile", self.volumes.read_file(&req))
    }

    fn remove_volume(&self, _ctx: &TtrpcContext, req: RemoveVolumeRequest) -> ttrpc::Result<Empty> {
        reply(
            "RemoveVolume",
            self.volumes.remove(&req.name).map(|()| Empty::new()),
        )
    }
}

impl AgentService {
    /// PrepareVolume: the volume (once its disk, if any, is seen at its
    /// size), then its content if it has some.
    fn prepare_one(&self, mut req: PrepareVolumeRequest) -> Result<()> {
        if !req.device.is_empty() {
            wait_for_capacity(Path::new(&req.device), req.device_bytes)?;
        }
        if req.has_content && !req.share.is_empty() {
            return Err(AgentError::InvalidArgument(format!(
                "volume {}: a file share has the host's content, not entries",
                req.name
            )));
        }
        self.volumes.prepare(&req)?;
        if req.has_content {
            let sync = SyncVolumeRequest {
                name: req.name.clone(),
                entries: std::mem::take(&mut req.entries),
                ..Default::default()
            };
            self.volumes.sync(sync)?;
        }
        Ok(())
    }

    /// Starts the sandbox API of the pod whose pause (`pid`) started: in
    /// the pause's network namespace, unless that is the agent's own on a
    /// host. A failure costs the pod its API only (logged).
    fn start_envd(&self, id: &str, pid: u32, policy: crate::envd::Policy) {
        let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/net")).ok();
        if !self.envd_in_agent_net && ns(&pid.to_string()) == ns("self") {
            tracing::info!(
                id,
                "no sandbox API: the pod shares the host agent's network"
            );
            return;
        }
        let pid = i32::try_from(pid).unwrap_or_default();
        match crate::envd::start(
            id,
            pid,
            policy,
            self.containers.clone(),
            self.reaper.clone(),
        ) {
            Ok(envd) => {
                lock(&self.envd).insert(id.to_string(), envd);
            }
            Err(e) => tracing::warn!(id, "starting the sandbox API (envd): {e}"),
        }
    }

    /// Makes the sandbox API of every running sandbox container (a VM
    /// restored from a snapshot: the one of the snapshotted pod, which the
    /// new pod adopts) what the pod asks: started, or stopped; a running
    /// one without a token takes the pod's.
    fn set_envd(&self, policy: &EnvdPolicy) {
        let digest = <[u8; 32]>::try_from(policy.token_sha256.as_slice()).ok();
        for c in self.containers.all() {
            let (id, pid) = {
                let c = lock(&c);
                match &c.state {
                    State::Started(p) if c.pause && p.exited().is_none() => (c.id.clone(), p.pid),
                    _ => continue,
                }
            };
            if !policy.on {
                if lock(&self.envd).remove(&id).is_some() {
                    tracing::info!(id, "sandbox API stopped: the restored pod has none");
                }
                continue;
            }
            let running = lock(&self.envd)
                .get(&id)
                .map(|envd| digest.map(|d| envd.require_token(d)))
                .is_some();
            if !running {
                self.start_envd(
                    &id,
                    u32::try_from(pid).unwrap_or_default(),
                    crate::envd::Policy {
                        token_sha256: digest,
                    },
                );
            }
        }
    }

    /// Gives `hostname` to every running container that has a hostname of
    /// its own (its own UTS namespace, a pod's sandbox container): after a
    /// clone, the restored pod's containers answer with the clone's name.
    fn rename_containers(&self, hostname: &str) -> Result<()> {
        if hostname.is_empty() {
            return Ok(());
        }
        for c in self.containers.all() {
            let pid = {
                let c = lock(&c);
                let own = c.spec.hostname().as_deref().is_some_and(|h| !h.is_empty());
                match &c.state {
                    State::Started(p) if own && p.exited().is_none() => p.pid,
                    _ => continue,
                }
            };
            crate::reidentify::set_hostname_of(pid, hostname)?;
        }
        Ok(())
    }
}

/// Starts serving `agent` on `listen` (`vsock://cid:port`, `unix://path`).
pub fn serve(listen: &str, agent: Arc<AgentService>) -> ttrpc::Result<ttrpc::Server> {
    if let Some(path) = listen.strip_prefix("unix://") {
        // A stale socket from an earlier run would make bind fail.
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            let _ = std::fs::remove_file(path);
        }
    }
    let service: Arc<dyn Agent + Send + Sync> = agent;
    let mut server = ttrpc::Server::new()
        .bind(listen)?
        .register_service(create_agent(service));
    server.start()?;
    Ok(server)
}
