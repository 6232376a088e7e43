//! The two VMMs behind one interface, each driven only through its own API
//! over its Unix socket: `twig-vmm serve` (line JSON, twig_vmm's `Client`)
//! and Firecracker (HTTP). Each instance writes the guest's serial output to
//! a file of its own.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use twig_store::NodeStore;
use twig_vmm::api::Client;
use twig_vmm::Kind;

use super::http::Http;
use super::T;
use crate::stats::{Context, Error};
use crate::vmm::VmmProcess;

/// Guest RAM of every VM, MiB.
pub const MEM_MIB: usize = 128;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Which {
    Twig,
    Firecracker,
}

impl Which {
    pub fn name(self) -> &'static str {
        match self {
            Which::Twig => "twig",
            Which::Firecracker => "firecracker",
        }
    }
}

/// What a benchmark run needs to start VMMs.
pub struct Env {
    pub twig: PathBuf,
    pub firecracker: PathBuf,
    pub store: NodeStore,
    /// Where sockets, serial files and Firecracker's snapshots go.
    pub dir: PathBuf,
    next: usize,
}

impl Env {
    pub fn new(twig: PathBuf, firecracker: PathBuf, store: NodeStore, dir: PathBuf) -> Env {
        Env {
            twig,
            firecracker,
            store,
            dir,
            next: 0,
        }
    }

    pub fn fresh(&mut self, tag: &str) -> PathBuf {
        self.next += 1;
        self.dir.join(format!("{tag}-{}", self.next))
    }

    fn fresh_id(&mut self, tag: &str) -> String {
        self.next += 1;
        format!("{tag}-{}", self.next)
    }
}

/// A snapshot either VMM can restore.
pub struct Snap {
    /// twig: the published snapshot directory; Firecracker: its state file.
    pub state: PathBuf,
    /// The guest memory file (what a restored VMM maps).
    pub memory: PathBuf,
}

/// What a snapshot call did.
pub struct SnapResult {
    pub snap: Snap,
    /// The snapshot call itself.
    pub call: Duration,
    /// How long the guest was stopped: twig's `pause_ms`; Firecracker's
    /// pause + create + resume calls.
    pub stopped: Duration,
    /// twig only: publishing the staged snapshot (the node store's rename).
    pub publish: Option<Duration>,
    /// Serial bytes the guest had printed when it was stopped: at least
    /// `.0`, at most `.1` (twig pauses inside its call).
    pub printed: (u64, u64),
}

enum Api {
    Twig(VmmProcess, Client),
    Fc(Child, Http),
}

/// One running VMM process.
pub struct Instance {
    pub which: Which,
    pub serial: PathBuf,
    /// From spawn to a connection to its API socket.
    pub spawn_to_api: Duration,
    api: Api,
}

/// Starts a VMM and connects to its API (Firecracker: also points its
/// serial console at `serial`). `prepare`: twig-vmm makes the VM of the
/// right shape at start (`--prepare-mem-mib`), as twig-node's warm pool does.
pub fn start(env: &mut Env, which: Which, prepare: bool) -> Result<Instance, Error> {
    let sock = env.fresh(&format!("{}.sock", which.name()));
    let serial = env.fresh(&format!("{}.serial", which.name()));
    let start = Instant::now();
    let spawn_to_api;
    let api = match which {
        Which::Twig => {
            let mib = MEM_MIB.to_string();
            let extra: &[&str] = if prepare {
                &["--prepare-mem-mib", &mib]
            } else {
                &[]
            };
            let mut p = VmmProcess::spawn_with(&env.twig, sock, &serial, extra)?;
            let api = p.connect()?;
            spawn_to_api = start.elapsed();
            Api::Twig(p, api)
        }
        Which::Firecracker => {
            let log = env.fresh("firecracker.log");
            let out = File::create(&log).context(|| format!("creating {}", log.display()))?;
            let err = out.try_clone()?;
            let mut child = std::process::Command::new(&env.firecracker)
                .arg("--api-sock")
                .arg(&sock)
                .args(["--level", "Warn"])
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .context(|| format!("starting {}", env.firecracker.display()))?;
            let mut http = connect_http(&mut child, &sock, &log)?;
            spawn_to_api = start.elapsed();
            let body = format!(r#"{{"serial_out_path":"{}"}}"#, serial.display());
            http.ok("PUT", "/serial", &body)?;
            Api::Fc(child, http)
        }
    };
    Ok(Instance {
        which,
        serial,
        spawn_to_api,
        api,
    })
}

fn connect_http(child: &mut Child, sock: &Path, log: &Path) -> Result<Http, Error> {
    let deadline = Instant::now() + T;
    loop {
        match Http::connect(sock, T) {
            Ok(h) => return Ok(h),
            Err(e) => {
                if let Some(status) = child.try_wait()? {
                    let text = fs::read_to_string(log).unwrap_or_default();
                    return Err(format!(
                        "firecracker exited with {status} before listening: {}",
                        text.trim()
                    )
                    .into());
                }
                if Instant::now() > deadline {
                    return Err(format!("connecting to {}: {e}", sock.display()).into());
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

impl Instance {
    pub fn pid(&self) -> u32 {
        match &self.api {
            Api::Twig(p, _) => p.pid(),
            Api::Fc(c, _) => c.id(),
        }
    }

    /// Boots `kernel` (128 MiB, 1 vCPU); returns when the VMM says it runs.
    pub fn boot(&mut self, kernel: &Path) -> Result<(), Error> {
        match &mut self.api {
            Api::Twig(_, api) => {
                api.boot(kernel, None, "console=ttyS0", MEM_MIB, 1, T)?;
            }
            Api::Fc(_, http) => {
                let body = format!(
                    r#"{{"kernel_image_path":"{}","boot_args":"console=ttyS0"}}"#,
                    kernel.display()
                );
                http.ok("PUT", "/boot-source", &body)?;
                // Dirty page tracking, as twig-vmm always has it: Firecracker
                // needs it for diff snapshots.
                let body = format!(
                    r#"{{"vcpu_count":1,"mem_size_mib":{MEM_MIB},"track_dirty_pages":true}}"#
                );
                http.ok("PUT", "/machine-config", &body)?;
                http.ok("PUT", "/actions", r#"{"action_type":"InstanceStart"}"#)?;
            }
        }
        Ok(())
    }

    pub fn pause(&mut self) -> Result<(), Error> {
        match &mut self.api {
            Api::Twig(_, api) => {
                api.pause(T)?;
            }
            Api::Fc(_, http) => {
                http.ok("PATCH", "/vm", r#"{"state":"Paused"}"#)?;
            }
        }
        Ok(())
    }

    pub fn resume(&mut self) -> Result<(), Error> {
        match &mut self.api {
            Api::Twig(_, api) => {
                api.resume(T)?;
            }
            Api::Fc(_, http) => {
                http.ok("PATCH", "/vm", r#"{"state":"Resumed"}"#)?;
            }
        }
        Ok(())
    }

    /// A full or diff (incremental) snapshot of the running guest, which
    /// runs on after it. Firecracker snapshots only a paused VM: it is
    /// paused, snapshotted and resumed, and all of that stops the guest.
    pub fn snapshot(&mut self, env: &mut Env, full: bool) -> Result<SnapResult, Error> {
        let serial = self.serial.clone();
        match &mut self.api {
            Api::Twig(_, api) => {
                let id = env.fresh_id(if full { "full" } else { "diff" });
                let staging = env
                    .store
                    .stage(&id)
                    .context(|| format!("staging snapshot {id}"))?;
                let kind = if full { Kind::Full } else { Kind::Incremental };
                let lo = len(&serial);
                let start = Instant::now();
                let info = api.snapshot(staging.dir(), kind, T)?;
                let call = start.elapsed();
                let hi = len(&serial);
                let start = Instant::now();
                staging
                    .publish()
                    .context(|| format!("publishing snapshot {id}"))?;
                let publish = start.elapsed();
                let dir = env.store.snapshot_dir(&id);
                Ok(SnapResult {
                    snap: Snap {
                        memory: dir.join("memory"),
                        state: dir,
                    },
                    call,
                    stopped: Duration::from_secs_f64(info.pause_ms / 1e3),
                    publish: Some(publish),
                    printed: (lo, hi),
                })
            }
            Api::Fc(_, http) => {
                let base = env.fresh(if full { "fc-full" } else { "fc-diff" });
                let state = base.with_extension("state");
                let memory = base.with_extension("memory");
                let body = format!(
                    r#"{{"snapshot_type":"{}","snapshot_path":"{}","mem_file_path":"{}"}}"#,
                    if full { "Full" } else { "Diff" },
                    state.display(),
                    memory.display()
                );
                let start = Instant::now();
                http.ok("PATCH", "/vm", r#"{"state":"Paused"}"#)?;
                let printed = len(&serial);
                let t1 = Instant::now();
                http.ok("PUT", "/snapshot/create", &body)?;
                let call = t1.elapsed();
                http.ok("PATCH", "/vm", r#"{"state":"Resumed"}"#)?;
                let stopped = start.elapsed();
                Ok(SnapResult {
                    snap: Snap { state, memory },
                    call,
                    stopped,
                    publish: None,
                    printed: (printed, printed),
                })
            }
        }
    }

    /// Restores `snap` into this (fresh) VMM and runs it; returns when the
    /// VMM says it runs.
    pub fn restore(&mut self, snap: &Snap) -> Result<(), Error> {
        match &mut self.api {
            Api::Twig(_, api) => {
                api.restore(&snap.state, T)?;
            }
            Api::Fc(_, http) => {
                let body = format!(
                    r#"{{"snapshot_path":"{}","mem_backend":{{"backend_type":"File","backend_path":"{}"}},"track_dirty_pages":true,"resume_vm":true}}"#,
                    snap.state.display(),
                    snap.memory.display()
                );
                http.ok("PUT", "/snapshot/load", &body)?;
            }
        }
        Ok(())
    }

    /// Stops the VMM (twig-vmm through its API; Firecracker killed) and
    /// removes its serial file.
    pub fn stop(self) -> Result<(), Error> {
        match self.api {
            Api::Twig(p, mut api) => p.shutdown(&mut api)?,
            Api::Fc(mut child, _) => {
                let _ = child.kill();
                child.wait().context(|| "waiting for firecracker".into())?;
            }
        }
        let _ = fs::remove_file(&self.serial);
        Ok(())
    }
}

/// Bytes in a serial file (0 before it exists).
pub fn len(path: &Path) -> u64 {
    fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}
