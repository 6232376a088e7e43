//! Host-side client of the agent.
//!
//! [`AgentClient`] connects either through a VMM's vsock Unix socket (the
//! Firecracker-style `CONNECT <port>` handshake of [`twig_proto::vsock`]) or
//! through a plain Unix socket (an agent started with `--listen unix://...`
//! on the host), and wraps every rpc in a typed, blocking method with a
//! deadline.
//!
//! Underneath, every connection of the process is served by ttrpc's tokio
//! client on one shared thread ([`io_runtime`]) that sleeps until a call or
//! a reply arrives. ttrpc's synchronous client polls each connection's
//! socket every 10 ms on a thread of its own: 100 wake-ups a second for
//! every connection, and every shim of a node holds one for as long as its
//! pod runs (in the lab, the shims of 40 running pods took half of the
//! node's CPU that way).

use std::future::Future;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::proto::agent::{
    ContainerRequest, CreateContainerRequest, ExecProcessRequest, PingRequest, PingResponse,
    PrepareVolumeRequest, PrepareVolumesRequest, ProcessRequest, ReadStreamRequest,
    ReadVolumeFileRequest, ReadVolumeFileResponse, ReidentifyRequest, RemoveVolumeRequest,
    ResizeTtyRequest, SignalProcessRequest, StatsResponse, SyncVolumeRequest,
    UpdateContainerRequest, VolumeEntry, WaitProcessRequest, WriteStdinRequest,
};
use crate::proto::agent_ttrpc_async::AgentClient as RawClient;

/// Extra time the client allows on top of a server-side wait (WaitProcess,
/// ReadStdout/ReadStderr) before it gives up on the reply.
pub const CALL_SLACK: Duration = Duration::from_secs(5);

/// The longest server-side wait the agent honours in one call; longer waits
/// are split into several calls by the helpers here.
pub const MAX_SERVER_WAIT: Duration = Duration::from_secs(60);

/// The largest ttrpc message (encoded request) either side takes: a
/// SyncVolume whose entries come near it fails with [`Error::Transport`].
pub const MAX_MESSAGE_BYTES: usize = ttrpc::proto::MESSAGE_LENGTH_MAX;

/// The most ReadVolumeFile returns (a larger `max_bytes` is cut to it).
pub const MAX_VOLUME_READ_BYTES: u32 = 64 << 10;

/// `PATH` given to processes started by [`AgentClient::run`].
pub const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The disks a new container gets: its root file system's device and its
/// raw block volumes.
#[derive(Debug, Clone, Default)]
pub struct ContainerDisks {
    /// The block device holding its root file system (ext4).
    pub rootfs_device: String,
    /// Whether the root file system is mounted read-only.
    pub rootfs_read_only: bool,
    /// The rootfs device was attached a moment ago with this size: the
    /// agent first waits (up to 2 s) until the guest sees it, as a
    /// hot-swapped disk's new capacity shows only once the guest handled
    /// the device's configuration-change interrupt (0: no wait).
    pub rootfs_bytes: u64,
    /// Its raw block volumes (a pod's `volumeDevices`).
    pub block_volumes: Vec<crate::proto::agent::BlockVolume>,
}

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be reached.
    #[error("connecting to {path}: {source}")]
    Connect {
        /// The Unix socket path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The vsock `CONNECT` handshake failed (refused, bad answer, timeout).
    #[error(transparent)]
    Vsock(#[from] twig_proto::vsock::Error),
    /// The agent answered with an error status.
    #[error("{call}: agent replied {code}: {message}")]
    Status {
        /// The rpc.
        call: &'static str,
        /// The ttrpc status code, e.g. `NOT_FOUND`.
        code: String,
        /// The agent's message.
        message: String,
    },
    /// No reply arrived before the deadline.
    #[error("{call}: no reply within {timeout:?}")]
    Timeout {
        /// The rpc.
        call: &'static str,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// The connection or the encoding failed.
    #[error("{call}: {message}")]
    Transport {
        /// The rpc.
        call: &'static str,
        /// The ttrpc error.
        message: String,
    },
    /// A helper's own deadline passed (e.g. a process did not exit in time).
    #[error("{0}")]
    Deadline(String),
}

impl Error {
    /// The ttrpc status code name (`"NOT_FOUND"`, `"INVALID_ARGUMENT"`, ...)
    /// when the agent replied with an error status.
    pub fn status_code(&self) -> Option<&str> {
        match self {
            Error::Status { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// Result of the client.
pub type Result<T> = std::result::Result<T, Error>;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessExit {
    /// Exit code, or 128 + signal if a signal killed it.
    pub status: i32,
    /// The signal that killed it, 0 if it exited.
    pub signal: i32,
    /// The container's memory limit OOM-killed one of its processes while
    /// this one ran (containerd's TaskOOM, CRI's `OOMKilled`).
    pub oom_killed: bool,
}

/// Which output stream of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output (for a TTY process: the terminal's output).
    Stdout,
    /// Standard error (always empty for a TTY process).
    Stderr,
}

/// One read of an output stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamChunk {
    /// The bytes read (possibly none if the wait ran out).
    pub data: Vec<u8>,
    /// The stream is closed and everything has been read.
    pub eof: bool,
}

/// containerd's default capabilities (what CRI gives a container that asks
/// for none), in OCI's `bounding`/`effective`/`permitted` sets. A process
/// spec without `capabilities` gets none (runc's rule).
pub const DEFAULT_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// A synchronous client of one agent. Cloning shares the connection; clones
/// may issue calls concurrently, from any thread (a tokio worker's too: a
/// call blocks its caller, it never starts a runtime).
#[derive(Clone)]
pub struct AgentClient {
    raw: RawClient,
}

/// The runtime every agent connection of this process lives on: one
/// thread, `twig-agent-io`, asleep unless a call or a reply is in flight.
fn io_runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> =
        OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("twig-agent-io")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Transport {
            call: "connect",
            message: format!("starting the agent client's I/O thread: {e}"),
        })
}

fn context(timeout: Duration) -> ttrpc::context::Context {
    let ns = i64::try_from(timeout.as_nanos()).unwrap_or(i64::MAX).max(1);
    ttrpc::context::with_timeout(ns)
}

fn map_err(call: &'static str, timeout: Duration, e: ttrpc::Error) -> Error {
    match e {
        ttrpc::Error::RpcStatus(s) => Error::Status {
            call,
            code: format!("{:?}", s.code()),
            message: s.message().to_string(),
        },
        // ttrpc's own deadline ("Request deadline elapsed").
        ttrpc::Error::Others(m) if m.contains("deadline") || m.contains("timeout") => {
            Error::Timeout { call, timeout }
        }
        other => Error::Transport {
            call,
            message: other.to_string(),
        },
    }
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.min(MAX_SERVER_WAIT).as_millis()).unwrap_or(u32::MAX)
}

impl AgentClient {
    /// Connects through a VMM's vsock Unix socket: writes `CONNECT <port>\n`,
    /// expects `OK <n>\n` before `timeout`, then speaks ttrpc on the stream.
    pub fn connect_vsock_uds(uds_path: &Path, port: u32, timeout: Duration) -> Result<Self> {
        let stream = twig_proto::vsock::connect(uds_path, port, timeout)?;
        Self::from_stream(stream, uds_path)
    }

    /// Waits until the agent in a booting or just-restored VM answers: tries
    /// the vsock handshake and a ping until one succeeds or `timeout`
    /// passes, and returns the connected client. The error at the deadline
    /// is the last attempt's. An attempt is bounded by 5 s at first, and
    /// each one that ran out of time gives the next twice as long: a
    /// connection lost to the restore's transport reset is given up soon,
    /// and a guest that answers slower than any bound (a node starting
    /// many VMs at once) is still waited for.
    pub fn wait_ready(uds_path: &Path, port: u32, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        let mut bound = Duration::from_secs(5);
        loop {
            let attempt = deadline
                .saturating_duration_since(Instant::now())
                .min(bound)
                .max(Duration::from_millis(1));
            let tried = Instant::now();
            let result = Self::connect_vsock_uds(uds_path, port, attempt)
                .and_then(|c| c.ping(attempt).map(|_| c));
            match result {
                Ok(client) => return Ok(client),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) if tried.elapsed() >= bound => bound *= 2,
                Err(_) => {
                    // Nothing listens yet: try again shortly, never past
                    // the deadline.
                    let left = deadline.saturating_duration_since(Instant::now());
                    std::thread::sleep(pause.min(left));
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
            }
        }
    }

    /// Connects to an agent listening on a plain Unix socket
    /// (`twig-agent --listen unix://<path>`), retrying until `timeout` while
    /// the socket does not exist yet or refuses connections.
    pub fn connect_unix(path: &Path, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            match UnixStream::connect(path) {
                Ok(stream) => return Self::from_stream(stream, path),
                Err(e)
                    if Instant::now() < deadline
                        && matches!(
                            e.kind(),
                            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                        ) =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(source) => {
                    return Err(Error::Connect {
                        path: path.to_path_buf(),
                        source,
                    })
                }
            }
        }
    }

    fn from_stream(stream: UnixStream, path: &Path) -> Result<Self> {
        let connect = |source| Error::Connect {
            path: path.to_path_buf(),
            source,
        };
        stream.set_nonblocking(true).map_err(connect)?;
        let _on_io_thread = io_runtime()?.enter();
        let stream = tokio::net::UnixStream::from_std(stream).map_err(connect)?;
        let client = ttrpc::asynchronous::Client::new(stream.into());
        Ok(AgentClient {
            raw: RawClient::new(client),
        })
    }

    /// Runs rpc `call` (made by `f` on the connection) on the I/O thread
    /// and waits for its reply, at most `timeout`.
    fn call<T, F, Fut>(&self, call: &'static str, timeout: Duration, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(RawClient) -> Fut,
        Fut: Future<Output = ttrpc::Result<T>> + Send + 'static,
    {
        let rpc = f(self.raw.clone());
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        io_runtime()?.spawn(async move {
            // Nobody waits any more if the caller's thread is gone.
            let _ = tx.send(tokio::time::timeout(timeout, rpc).await);
        });
        match rx.recv() {
            Ok(Ok(reply)) => reply.map_err(|e| map_err(call, timeout, e)),
            Ok(Err(_)) => Err(Error::Timeout { call, timeout }),
            Err(_) => Err(Error::Transport {
                call,
                message: "the agent client's I/O thread dropped the call".into(),
            }),
        }
    }

    /// Ping: the agent's version and the guest's uptime.
    pub fn ping(&self, timeout: Duration) -> Result<PingResponse> {
        self.call("Ping", timeout, move |raw| async move {
            raw.ping(context(timeout), &PingRequest::new()).await
        })
    }

    /// Mounts `rootfs_device` (ext4) and prepares container `container_id`
    /// from the OCI runtime spec `oci_spec_json` (config.json).
    pub fn create_container(
        &self,
        container_id: &str,
        rootfs_device: &str,
        rootfs_read_only: bool,
        oci_spec_json: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        self.create_container_on_disks(
            container_id,
            ContainerDisks {
                rootfs_device: rootfs_device.to_string(),
                rootfs_read_only,
                ..Default::default()
            },
            oci_spec_json,
            timeout,
        )
    }

    /// [`AgentClient::create_container`] on `disks`, attached a moment ago
    /// (sizes rounded down to whole 512-byte sectors).
    pub fn create_container_on_disks(
        &self,
        container_id: &str,
        disks: ContainerDisks,
        oci_spec_json: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        self.create(
            CreateContainerRequest {
                container_id: container_id.to_string(),
                rootfs_device: disks.rootfs_device,
                rootfs_read_only: disks.rootfs_read_only,
                rootfs_bytes: disks.rootfs_bytes,
                block_volumes: disks.block_volumes,
                oci_spec_json: oci_spec_json.to_vec(),
                ..Default::default()
            },
            timeout,
        )
    }

    /// Prepares a pod's sandbox container `container_id`, which has no
    /// root file system: its init is the agent's built-in pause, holding
    /// the namespaces, hostname and sysctls of `oci_spec_json` (the
    /// spec's process is not run).
    pub fn create_pause(
        &self,
        container_id: &str,
        oci_spec_json: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        self.create(
            CreateContainerRequest {
                container_id: container_id.to_string(),
                builtin_pause: true,
                oci_spec_json: oci_spec_json.to_vec(),
                ..Default::default()
            },
            timeout,
        )
    }

    fn create(&self, req: CreateContainerRequest, timeout: Duration) -> Result<()> {
        self.call("CreateContainer", timeout, move |raw| async move {
            raw.create_container(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Starts the container's init process; returns its pid (in the VM).
    pub fn start_container(&self, container_id: &str, timeout: Duration) -> Result<u32> {
        let req = ContainerRequest {
            container_id: container_id.to_string(),
            ..Default::default()
        };
        self.call("StartContainer", timeout, move |raw| async move {
            raw.start_container(context(timeout), &req).await
        })
        .map(|r| r.pid)
    }

    /// Runs another process, described by an OCI `process` object as JSON,
    /// in a started container; returns its pid (in the VM).
    pub fn exec_process(
        &self,
        container_id: &str,
        exec_id: &str,
        oci_process_json: &[u8],
        timeout: Duration,
    ) -> Result<u32> {
        let req = ExecProcessRequest {
            container_id: container_id.to_string(),
            exec_id: exec_id.to_string(),
            oci_process_json: oci_process_json.to_vec(),
            ..Default::default()
        };
        self.call("ExecProcess", timeout, move |raw| async move {
            raw.exec_process(context(timeout), &req).await
        })
        .map(|r| r.pid)
    }

    /// Forgets the exec `exec_id` of `container_id`, which has exited.
    pub fn remove_process(
        &self,
        container_id: &str,
        exec_id: &str,
        timeout: Duration,
    ) -> Result<()> {
        let req = ProcessRequest {
            container_id: container_id.to_string(),
            exec_id: exec_id.to_string(),
            ..Default::default()
        };
        self.call("RemoveProcess", timeout, move |raw| async move {
            raw.remove_process(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Sends `signal` to a process (`exec_id` empty: the container's init).
    pub fn signal_process(
        &self,
        container_id: &str,
        exec_id: &str,
        signal: u32,
        timeout: Duration,
    ) -> Result<()> {
        let req = SignalProcessRequest {
            container_id: container_id.to_string(),
            exec_id: exec_id.to_string(),
            signal,
            ..Default::default()
        };
        self.call("SignalProcess", timeout, move |raw| async move {
            raw.signal_process(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Waits up to `wait` (at most [`MAX_SERVER_WAIT`] per call) for a
    /// process to exit; `None` if it is still running.
    pub fn wait_process(
        &self,
        container_id: &str,
        exec_id: &str,
        wait: Duration,
    ) -> Result<Option<ProcessExit>> {
        let req = WaitProcessRequest {
            container_id: container_id.to_string(),
            exec_id: exec_id.to_string(),
            timeout_ms: millis(wait),
            ..Default::default()
        };
        let deadline = wait.min(MAX_SERVER_WAIT) + CALL_SLACK;
        let r = self.call("WaitProcess", deadline, move |raw| async move {
            raw.wait_process(context(deadline), &req).await
        })?;
        Ok(r.exited.then_some(ProcessExit {
            status: r.exit_status,
            signal: r.signal,
            oom_killed: r.oom_killed,
        }))
    }

    /// Waits for a process to exit, for as long as `timeout`, over as many
    /// calls as needed; an error if it is still running then.
    pub fn wait_exit(
        &self,
        container_id: &str,
        exec_id: &str,
        timeout: Duration,
    ) -> Result<ProcessExit> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(exit) = self.wait_process(container_id, exec_id, left)? {
                return Ok(exit);
            }
            if left.is_zero() {
                return Err(Error::Deadline(format!(
                    "process {container_id:?}/{exec_id:?} still running after {timeout:?}"
                )));
            }
        }
    }

    /// Writes to a process's stdin; returns how much the agent wrote.
    pub fn write_stdin(
        &self,
        container_id: &str,
        exec_id: &str,
        data: &[u8],
        timeout: Duration,
    ) -> Result<u32> {
        let req = WriteStdinRequest {
            container_id: container_id.to_string(),
            exec_id: exec_id.to_string(),
            data: data.to_vec(),
            ..Default::default()
        };
        self.call("WriteStdin", timeout, move |raw| async move {
            raw.write_stdin(context(timeout), &req).await
        })
        .map(|r| r.written)
    }

    /// Closes a process's stdin (for a TTY: sends end-of-file, ^D).
    pub fn close_stdin(&self, container_id: &str, exec_id: &str, timeout: Duration) -> Result<()> {
        let req = ProcessRequest {
            container_id: container_id.to_string(),
            exec_id: exec_id.to_string(),
            ..Default::default()
        };
        self.call("CloseStdin", timeout, move |raw| async move {
            raw.close_stdin(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Reads up to `max_bytes` (0: the agent's default) of a stream, waiting
    /// up to `wait` for at least one byte.
    pub fn read_stream(
        &self,
        container_id: &str,
        exec_id: &str,
        stream: Stream,
        max_bytes: u32,
        wait: Duration,
    ) -> Result<StreamChunk> {
        let req = ReadStreamRequest {
            container_id: container_id.to_string(),
            exec_id: exec_id.to_string(),
            max_bytes,
            timeout_ms: millis(wait),
            ..Default::default()
        };
        let deadline = wait.min(MAX_SERVER_WAIT) + CALL_SLACK;
        let r = match stream {
            Stream::Stdout => self.call("ReadStdout", deadline, move |raw| async move {
                raw.read_stdout(context(deadline), &req).await
            })?,
            Stream::Stderr => self.call("ReadStderr", deadline, move |raw| async move {
                raw.read_stderr(context(deadline), &req).await
            })?,
        };
        Ok(StreamChunk {
            data: r.data,
            eof: r.eof,
        })
    }

    /// Reads a stream until end-of-file; an error if that takes longer than
    /// `timeout`.
    pub fn read_to_end(
        &self,
        container_id: &str,
        exec_id: &str,
        stream: Stream,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let chunk = self.read_stream(container_id, exec_id, stream, 0, left)?;
            out.extend_from_slice(&chunk.data);
            if chunk.eof {
                return Ok(out);
            }
            if left.is_zero() {
                return Err(Error::Deadline(format!(
                    "{stream:?} of {container_id:?}/{exec_id:?} not closed after {timeout:?} ({} bytes read)",
                    out.len()
                )));
            }
        }
    }

    /// Sets the window size of a TTY process.
    pub fn resize_tty(
        &self,
        container_id: &str,
        exec_id: &str,
        rows: u32,
        cols: u32,
        timeout: Duration,
    ) -> Result<()> {
        let req = ResizeTtyRequest {
            container_id: container_id.to_string(),
            exec_id: exec_id.to_string(),
            rows,
            cols,
            ..Default::default()
        };
        self.call("ResizeTty", timeout, move |raw| async move {
            raw.resize_tty(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Kills a container's processes and unmounts its rootfs.
    pub fn remove_container(&self, container_id: &str, timeout: Duration) -> Result<()> {
        let req = ContainerRequest {
            container_id: container_id.to_string(),
            ..Default::default()
        };
        self.call("RemoveContainer", timeout, move |raw| async move {
            raw.remove_container(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Memory and CPU use of a container's processes.
    pub fn stats(&self, container_id: &str, timeout: Duration) -> Result<StatsResponse> {
        let req = ContainerRequest {
            container_id: container_id.to_string(),
            ..Default::default()
        };
        self.call("Stats", timeout, move |raw| async move {
            raw.stats(context(timeout), &req).await
        })
    }

    /// Gives the VM a new identity; returns the guest's wall clock (ns since
    /// the epoch) before it was stepped.
    pub fn reidentify(&self, req: &ReidentifyRequest, timeout: Duration) -> Result<u64> {
        let req = req.clone();
        self.call("Reidentify", timeout, move |raw| async move {
            raw.reidentify(context(timeout), &req).await
        })
        .map(|r| r.previous_realtime_ns)
    }

    /// Changes container `container_id`'s limits in the VM to what
    /// `resources_json` (an OCI `linux.resources`) gives; the rest stays.
    pub fn update_container(
        &self,
        container_id: &str,
        resources_json: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        let req = UpdateContainerRequest {
            container_id: container_id.to_string(),
            resources_json: resources_json.to_vec(),
            ..Default::default()
        };
        self.call("UpdateContainer", timeout, move |raw| async move {
            raw.update_container(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Creates guest volume `req.name` (the directory
    /// `twig_proto::GUEST_VOLUMES_DIR/<name>` in the VM; a tmpfs of its own
    /// of `tmpfs_bytes` if not 0; a directory on the pod's disk `device`
    /// if set) unless it exists, resizes its tmpfs, and sets its mode and
    /// owner.
    pub fn prepare_volume(&self, req: &PrepareVolumeRequest, timeout: Duration) -> Result<()> {
        let req = req.clone();
        self.call("PrepareVolume", timeout, move |raw| async move {
            raw.prepare_volume(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// [`AgentClient::prepare_volume`] for each of `volumes` in order, in
    /// one call; the first failure stops the rest and names its volume.
    pub fn prepare_volumes(
        &self,
        volumes: Vec<PrepareVolumeRequest>,
        timeout: Duration,
    ) -> Result<()> {
        let req = PrepareVolumesRequest {
            volumes,
            ..Default::default()
        };
        self.call("PrepareVolumes", timeout, move |raw| async move {
            raw.prepare_volumes(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Makes volume `name`'s tree equal to `entries`: directories and
    /// changed files, then symlinks, then removal of what is not listed
    /// (kubelet's `..data` swap stays atomic for readers in the guest).
    pub fn sync_volume(
        &self,
        name: &str,
        entries: Vec<VolumeEntry>,
        timeout: Duration,
    ) -> Result<()> {
        let req = SyncVolumeRequest {
            name: name.to_string(),
            entries,
            ..Default::default()
        };
        self.call("SyncVolume", timeout, move |raw| async move {
            raw.sync_volume(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Reads up to `max_bytes` (0 or more than [`MAX_VOLUME_READ_BYTES`]:
    /// that) of regular file `path` of volume `name`; `truncated` if it
    /// holds more. A missing file or volume is `NOT_FOUND`.
    pub fn read_volume_file(
        &self,
        name: &str,
        path: &str,
        max_bytes: u32,
        timeout: Duration,
    ) -> Result<ReadVolumeFileResponse> {
        let req = ReadVolumeFileRequest {
            name: name.to_string(),
            path: path.to_string(),
            max_bytes,
            ..Default::default()
        };
        self.call("ReadVolumeFile", timeout, move |raw| async move {
            raw.read_volume_file(context(timeout), &req).await
        })
    }

    /// Unmounts and deletes volume `name`; a missing one is no error.
    pub fn remove_volume(&self, name: &str, timeout: Duration) -> Result<()> {
        let req = RemoveVolumeRequest {
            name: name.to_string(),
            ..Default::default()
        };
        self.call("RemoveVolume", timeout, move |raw| async move {
            raw.remove_volume(context(timeout), &req).await
        })
        .map(|_| ())
    }

    /// Runs `args` as exec `exec_id` in a started container (no TTY, cwd
    /// `/`, uid 0 with containerd's default capabilities, [`DEFAULT_CAPS`],
    /// a default `PATH`), reads stdout and stderr to their end
    /// and waits for the exit; all within `timeout`. Returns (exit status,
    /// stdout, stderr); the exit status is 128 + signal if a signal killed it.
    pub fn run(
        &self,
        container_id: &str,
        exec_id: &str,
        args: &[&str],
        timeout: Duration,
    ) -> Result<(i32, Vec<u8>, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        let process = serde_json::json!({
            "args": args,
            "env": [DEFAULT_PATH],
            "cwd": "/",
            "user": { "uid": 0, "gid": 0 },
            "terminal": false,
            "capabilities": {
                "bounding": DEFAULT_CAPS,
                "effective": DEFAULT_CAPS,
                "permitted": DEFAULT_CAPS,
            },
        });
        let json = serde_json::to_vec(&process).map_err(|e| Error::Transport {
            call: "ExecProcess",
            message: format!("encoding the process: {e}"),
        })?;
        self.exec_process(container_id, exec_id, &json, timeout)?;
        let left = || deadline.saturating_duration_since(Instant::now());
        let (stdout, stderr) = std::thread::scope(|s| {
            let err = s.spawn(|| self.read_to_end(container_id, exec_id, Stream::Stderr, left()));
            let out = self.read_to_end(container_id, exec_id, Stream::Stdout, left());
            let err = err
                .join()
                .unwrap_or_else(|_| Err(Error::Deadline("the stderr reader panicked".to_string())));
            (out, err)
        });
        let (stdout, stderr) = (stdout?, stderr?);
        let exit = self.wait_exit(container_id, exec_id, left())?;
        Ok((exit.status, stdout, stderr))
    }
}
