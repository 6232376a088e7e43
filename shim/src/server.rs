//! The shim binary's three actions, as containerd's runtime v2 calls them:
//! `start` (find or spawn the pod's shim, print its address), the server
//! itself (no action: serve the Task API on the socket), and `delete`
//! (clean up after a shim that died).
//!
//! Compatibility: containerd 1.6/1.7 read `start`'s stdout as a bare
//! address and call the service `containerd.task.v2.Task`; containerd 2.x
//! takes a bare address as a v2 shim too. The `containerd-shim` crate's own
//! `run` answers with a JSON reply and serves only `containerd.task.v3.Task`
//! (containerd ≥ 2.0), so this shim does its own start and registers the
//! one service under both names (v3 is a renamed copy of v2).

use std::collections::HashMap;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::Flags;
use containerd_shim_protos::api::DeleteResponse;
use containerd_shim_protos::shim_async::{create_task, Task};
use containerd_shim_protos::ttrpc::context::Context;
use containerd_shim_protos::ttrpc::r#async::transport::Listener;
use containerd_shim_protos::ttrpc::r#async::{Server, Service};
use tokio::sync::mpsc;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::pod::process::timestamp;
use crate::pod::Event;
use crate::service::TaskService;
use crate::spec;
use crate::twig_service::{TwigService, DEFAULT_QUEUE_DEADLINE};
use crate::vm::{VmLauncher, PID_FILE};

/// containerd's name for this runtime.
pub const RUNTIME_ID: &str = "io.containerd.twig.v2";
/// The task service's name for containerd 1.x.
pub const TASK_V2: &str = "containerd.task.v2.Task";
/// The environment variable telling the server its listener is fd 3.
pub const LISTEN_FD_ENV: &str = "TWIG_SHIM_LISTEN_FD";
const LISTEN_FD: i32 = 3;
/// The environment variable containerd sets to its ttrpc address (events).
pub const TTRPC_ADDRESS: &str = "TTRPC_ADDRESS";

/// The Task service under both names containerd uses.
pub fn task_services(task: TaskService) -> HashMap<String, Service> {
    let task: Arc<dyn Task + Send + Sync> = Arc::new(task);
    let mut services = create_task(task.clone());
    if let Some((_, v2)) = create_task(task).into_iter().next() {
        services.insert(TASK_V2.to_string(), v2);
    }
    services
}

fn socket_path(address: &str) -> &str {
    address.strip_prefix("unix://").unwrap_or(address)
}

/// Where the pod's VM keeps its sockets and logs: a short directory named
/// after the shim's socket (itself a hash of containerd's address,
/// namespace and the pod's grouping).
pub fn state_dir(config: &Config, address: &str) -> PathBuf {
    let name = Path::new(socket_path(address))
        .file_name()
        .map(|n| n.to_string_lossy().chars().take(16).collect::<String>())
        .unwrap_or_default();
    config.state_root.join(name)
}

/// The shim address of the container in `bundle`.
pub fn address_for(flags: &Flags, bundle: &Path) -> Result<String> {
    let oci = spec::read_spec(bundle)?;
    let grouping = spec::grouping(&flags.id, &oci);
    Ok(containerd_shim::socket_address(
        &flags.address,
        &flags.namespace,
        &grouping,
    ))
}

/// The `start` action: returns the address of the pod's shim, spawning it
/// (with its listening socket as fd 3) unless one already serves it.
pub fn start(flags: &Flags) -> Result<String> {
    let bundle =
        std::env::current_dir().map_err(|e| Error::io("the bundle (current directory)", e))?;
    let address = address_for(flags, &bundle)?;
    let path = socket_path(&address).to_string();
    if let Some(dir) = Path::new(&path).parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    let listener = match UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) if e.kind() == ErrorKind::AddrInUse => {
            if UnixStream::connect(&path).is_ok() {
                // The pod's shim is running: this container joins it.
                write_address(&bundle, &address)?;
                return Ok(address);
            }
            std::fs::remove_file(&path)
                .map_err(|e| Error::io(format!("removing the stale socket {path}"), e))?;
            UnixListener::bind(&path).map_err(|e| Error::io(format!("listening on {path}"), e))?
        }
        Err(e) => return Err(Error::io(format!("listening on {path}"), e)),
    };
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the shim binary", e))?;
    let mut cmd = Command::new(exe);
    cmd.current_dir(&bundle)
        .args([
            "-namespace",
            &flags.namespace,
            "-id",
            &flags.id,
            "-address",
            &flags.address,
        ])
        .args([
            "-publish-binary",
            &flags.publish_binary,
            "-socket",
            &address,
        ])
        .env(LISTEN_FD_ENV, LISTEN_FD.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if flags.debug {
        cmd.arg("-debug");
    }
    let fd = listener.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and only
    // makes async-signal-safe calls (setsid, dup2, fcntl) on descriptors
    // it owns; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if fd == LISTEN_FD {
                // dup2 onto itself would keep close-on-exec.
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, LISTEN_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| Error::io("spawning the shim server", e))?;
    std::fs::write(bundle.join("shim.pid"), child.id().to_string())
        .map_err(|e| Error::io("writing shim.pid", e))?;
    write_address(&bundle, &address)?;
    Ok(address)
}

fn write_address(bundle: &Path, address: &str) -> Result<()> {
    std::fs::write(bundle.join("address"), address)
        .map_err(|e| Error::io(format!("writing {}/address", bundle.display()), e))
}

/// The `delete` action, run by containerd when its connection for one
/// container closed: if the pod's shim is gone, stops the pod's VMM if it
/// still runs and removes its state. containerd closes a container's
/// connection itself once the container is deleted, and then runs this
/// too; while the pod's shim still serves its socket, the VM belongs to
/// the pod's other containers and is left alone (as runc's shim deletes
/// only that one container). The process was killed with the VM: 128 +
/// SIGKILL, as runc's shim reports.
pub fn delete(flags: &Flags) -> Result<DeleteResponse> {
    let bundle =
        std::env::current_dir().map_err(|e| Error::io("the bundle (current directory)", e))?;
    let config = Config::load()?;
    match address_for(flags, &bundle) {
        Ok(address) if UnixStream::connect(socket_path(&address)).is_ok() => {
            tracing::info!(id = flags.id, "the pod's shim still serves; its VM stays");
        }
        Ok(address) => stop_orphan_vmm(&state_dir(&config, &address)),
        Err(e) => tracing::warn!("no spec in {}: {e}", bundle.display()),
    }
    Ok(DeleteResponse {
        pid: 0,
        exit_status: 128 + libc::SIGKILL as u32,
        exited_at: timestamp(SystemTime::now()),
        ..Default::default()
    })
}

fn stop_orphan_vmm(dir: &Path) {
    let recorded = std::fs::read_to_string(dir.join(PID_FILE)).unwrap_or_default();
    let mut lines = recorded.lines();
    let pid = lines.next().and_then(|s| s.trim().parse::<i32>().ok());
    // The API socket names this pod's VMM; a recycled pid (another pod's
    // VMM, or anything else) does not have it in its command line.
    let api_socket = lines.next().unwrap_or("twig-vmm").trim().to_string();
    if let Some(pid) = pid {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&api_socket) {
            tracing::info!(pid, api_socket, "killing the orphaned twig-vmm");
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        } else {
            tracing::info!(pid, api_socket, "the pod's twig-vmm is gone already");
        }
    }
    // The pod's network path, if the dead shim had attached one (the tap
    // went with the VMM, or goes with it now).
    if let Err(e) = crate::resources::network::teardown_recorded(dir) {
        tracing::warn!("tearing down the pod's network: {e}; its state stays for another try");
        return;
    }
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != ErrorKind::NotFound {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
}

/// The pod's sandbox id (the shim's group), from the bundle the server
/// starts in: the first container's.
fn sandbox_id(flags: &Flags) -> Result<String> {
    let bundle =
        std::env::current_dir().map_err(|e| Error::io("the bundle (current directory)", e))?;
    Ok(spec::grouping(&flags.id, &spec::read_spec(&bundle)?))
}

/// The server: serves the Task API and the `Twig` service until
/// containerd's Shutdown.
pub async fn serve(flags: Flags) -> Result<()> {
    let config = Config::load()?;
    let ttrpc_address = std::env::var(TTRPC_ADDRESS)
        .map_err(|_| Error::InvalidArgument(format!("{} is not set", TTRPC_ADDRESS)))?;
    let listener = if std::env::var_os(LISTEN_FD_ENV).is_some() {
        // SAFETY: `start` put the listening socket on fd 3 for this
        // process (and said so in the environment); nothing else owns it.
        unsafe { UnixListener::from_raw_fd(LISTEN_FD) }
    } else {
        let path = socket_path(&flags.socket);
        UnixListener::bind(path).map_err(|e| Error::io(format!("listening on {path}"), e))?
    };
    let publisher = RemotePublisher::new(&ttrpc_address).await.map_err(|e| {
        Error::Internal(format!(
            "connecting to containerd's events at {ttrpc_address}: {e}"
        ))
    })?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
    let namespace = flags.namespace.clone();
    tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            if let Err(e) = publisher
                .publish(Context::default(), ev.topic, &namespace, ev.message)
                .await
            {
                tracing::warn!(topic = ev.topic, "publishing: {e}");
            }
        }
    });
    let exit = Arc::new(ExitSignal::default());
    let timeout = Duration::from_secs(config.call_timeout_s);
    let launcher = Arc::new(VmLauncher::new(
        config.clone(),
        state_dir(&config, &flags.socket),
    ));
    let service = TaskService::new(launcher, tx, exit.clone(), timeout);
    let twig = TwigService::new(
        service.pod().clone(),
        sandbox_id(&flags)?,
        DEFAULT_QUEUE_DEADLINE,
    );
    let listener = Listener::try_from(listener).map_err(|e| Error::io("the ttrpc listener", e))?;
    let mut server = Server::new()
        .add_listener(listener)
        .register_service(task_services(service))
        .register_service(twig.services());
    server
        .start()
        .await
        .map_err(|e| Error::Internal(format!("starting the ttrpc server: {e}")))?;
    tracing::info!(socket = flags.socket, "serving");
    exit.wait().await;
    // Let the Shutdown reply reach containerd before the socket goes.
    tokio::time::sleep(Duration::from_millis(50)).await;
    if let Err(e) = server.shutdown().await {
        tracing::warn!("stopping the ttrpc server: {e}");
    }
    let _ = std::fs::remove_file(socket_path(&flags.socket));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_dirs_are_short_and_follow_the_socket() {
        let config = Config::default();
        let a =
            containerd_shim::socket_address("/run/containerd/containerd.sock", "k8s.io", "pod1");
        let b =
            containerd_shim::socket_address("/run/containerd/containerd.sock", "k8s.io", "pod2");
        let (da, db) = (state_dir(&config, &a), state_dir(&config, &b));
        assert_ne!(da, db);
        assert!(da.starts_with("/run/twig/shim"));
        // Room for the vsock socket and its per-port suffix under 108 bytes.
        assert!(
            da.join("vsock_1024").as_os_str().len() < 100,
            "{}",
            da.display()
        );
        assert_eq!(state_dir(&config, &a), da);
    }
}
