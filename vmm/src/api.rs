//! The JSON API of the `twig-vmm` binary: one VM per process, one request per
//! line on a Unix socket, one response per line.
//!
//! ```text
//! {"op":"boot","kernel":"/path/vmlinux","initrd":"/path/initrd","cmdline":"console=ttyS0","mem_mib":128,"vcpus":1}
//! {"op":"restore","dir":"/store/snapshots/a"}
//! {"op":"pause"}  {"op":"resume"}  {"op":"stats"}  {"op":"shutdown"}
//! {"op":"snapshot","dir":"/store/tmp/<lease>/b","kind":"incremental"}
//! {"op":"rollback","dir":"/store/snapshots/a"}
//! ```
//! A snapshot is written into a staging directory the node store handed out
//! (`twig_store::NodeStore::stage`); the store publishes it.
//! Every response is `{"ok":true,"result":…}` or `{"ok":false,"error":"…"}`.
//!
//! The VM gets the devices the server was started with (`--disk`, `--tap`,
//! `--vsock-uds`), whether it boots or restores; a restored VM's
//! read-write disk files get the snapshot's disk contents.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};

use crate::devices::SerialOut;
use crate::error::{Error, Result};
use crate::snapshot::{self, Kind};
use crate::vm::{DeviceConfig, Shape, Vm};

/// Longest request line accepted.
pub const MAX_REQUEST: usize = 64 * 1024;

fn default_mem() -> usize {
    128
}
fn default_vcpus() -> usize {
    1
}
fn default_kind() -> Kind {
    Kind::Full
}

/// A request.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Boot a kernel.
    Boot {
        kernel: PathBuf,
        #[serde(default)]
        initrd: Option<PathBuf>,
        #[serde(default)]
        cmdline: String,
        #[serde(default = "default_mem")]
        mem_mib: usize,
        #[serde(default = "default_vcpus")]
        vcpus: usize,
    },
    /// Restore a snapshot and run it.
    Restore { dir: PathBuf },
    /// Park the vCPUs.
    Pause {},
    /// Run the vCPUs.
    Resume {},
    /// Snapshot into a staging directory of the node store.
    Snapshot {
        dir: PathBuf,
        #[serde(default = "default_kind")]
        kind: Kind,
    },
    /// Roll back in place.
    Rollback { dir: PathBuf },
    /// Counters.
    Stats {},
    /// Stop the VM and exit.
    Shutdown {},
}

/// Makes serial writers for the VMs this server creates.
pub type SerialFactory = Box<dyn Fn() -> Result<SerialOut>>;

/// One VM and the server state around it.
pub struct Server {
    vm: Option<Vm>,
    prepared: Option<Vm>,
    serial: SerialFactory,
    devices: DeviceConfig,
}

impl Server {
    /// A server whose VM gets `devices`; with `prepare`, a VM of that shape
    /// is created now so that a later boot or restore of that shape skips
    /// VM creation.
    pub fn new(
        serial: SerialFactory,
        prepare: Option<Shape>,
        devices: DeviceConfig,
    ) -> Result<Server> {
        let prepared = match prepare {
            Some(shape) => Some(Vm::create_with(shape, serial()?, &devices)?),
            None => None,
        };
        Ok(Server {
            vm: None,
            prepared,
            serial,
            devices,
        })
    }

    fn fresh_vm(&mut self, shape: Shape) -> Result<&mut Vm> {
        if self.vm.is_some() {
            return Err(Error::Config(
                "this twig-vmm already has a VM; start another process for another VM".into(),
            ));
        }
        let vm = match self.prepared.take() {
            Some(vm) if vm.shape() == shape => vm,
            other => {
                // A prepared VM of another shape holds the devices (tap,
                // vsock socket): release them first.
                drop(other);
                Vm::create_with(shape, (self.serial)()?, &self.devices)?
            }
        };
        Ok(self.vm.insert(vm))
    }

    fn vm(&mut self) -> Result<&mut Vm> {
        self.vm
            .as_mut()
            .ok_or_else(|| Error::Config("no VM yet: boot or restore one first".into()))
    }

    /// Handles one request; the bool says whether to exit afterwards.
    pub fn handle(&mut self, req: Request) -> Result<(Value, bool)> {
        let v = match req {
            Request::Boot {
                kernel,
                initrd,
                cmdline,
                mem_mib,
                vcpus,
            } => {
                let shape = Shape::new(mem_mib, vcpus);
                let vm = self.fresh_vm(shape)?;
                if let Err(e) = vm.boot_linux(&kernel, initrd.as_deref(), &cmdline) {
                    self.vm = None;
                    return Err(e);
                }
                json!({"state": "running"})
            }
            Request::Restore { dir } => {
                let image = snapshot::Image::open(
                    &std::path::absolute(&dir)
                        .map_err(|e| Error::io(format!("resolving {}", dir.display()), e))?,
                )?;
                let shape = Shape {
                    mem_size: image.state.meta.mem_size as usize,
                    vcpus: image.state.meta.vcpus,
                };
                let vm = self.fresh_vm(shape)?;
                let r = vm.restore_image(&image).and_then(|_| vm.resume());
                if let Err(e) = r {
                    self.vm = None;
                    return Err(e);
                }
                json!({"id": image.id()})
            }
            Request::Pause {} => {
                self.vm()?.pause()?;
                json!({"state": "paused"})
            }
            Request::Resume {} => {
                self.vm()?.resume()?;
                json!({"state": "running"})
            }
            Request::Snapshot { dir, kind } => to_value(self.vm()?.snapshot(&dir, kind)?)?,
            Request::Rollback { dir } => to_value(self.vm()?.rollback(&dir)?)?,
            Request::Stats {} => to_value(self.vm()?.stats()?)?,
            Request::Shutdown {} => {
                self.vm = None;
                return Ok((json!({"state": "shut down"}), true));
            }
        };
        Ok((v, false))
    }

    /// Parses and handles one request line; returns the response line.
    pub fn handle_line(&mut self, line: &str) -> (String, bool) {
        let (resp, exit) = match serde_json::from_str::<Request>(line) {
            Err(e) => (
                json!({"ok": false, "error": format!("bad request: {e}")}),
                false,
            ),
            Ok(req) => match self.handle(req) {
                Ok((result, exit)) => (json!({"ok": true, "result": result}), exit),
                Err(e) => (json!({"ok": false, "error": e.to_string()}), false),
            },
        };
        (resp.to_string(), exit)
    }

    /// Serves clients on `listener` until a shutdown request.
    pub fn serve(&mut self, listener: &UnixListener) -> Result<()> {
        for conn in listener.incoming() {
            let conn = conn.map_err(|e| Error::io("accepting an API connection", e))?;
            match self.serve_conn(conn) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => tracing::warn!("API connection: {e}"),
            }
        }
        Ok(())
    }

    fn serve_conn(&mut self, conn: UnixStream) -> Result<bool> {
        let mut out = conn
            .try_clone()
            .map_err(|e| Error::io("cloning the API connection", e))?;
        let mut reader = BufReader::new(conn);
        let mut line = String::new();
        loop {
            line.clear();
            let n = (&mut reader)
                .take(MAX_REQUEST as u64 + 1)
                .read_line(&mut line)
                .map_err(|e| Error::io("reading an API request", e))?;
            if n == 0 {
                return Ok(false);
            }
            let (resp, exit) = if n > MAX_REQUEST {
                (
                    json!({"ok": false, "error": format!("request longer than {MAX_REQUEST} bytes")})
                        .to_string(),
                    false,
                )
            } else {
                self.handle_line(line.trim())
            };
            writeln!(out, "{resp}").map_err(|e| Error::io("writing an API response", e))?;
            if exit || n > MAX_REQUEST {
                return Ok(exit);
            }
        }
    }
}

fn to_value<T: serde::Serialize>(v: T) -> Result<Value> {
    serde_json::to_value(v).map_err(|e| Error::Config(format!("encoding a response: {e}")))
}

/// Binds the API socket, replacing a stale socket file nobody listens on.
pub fn bind(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(Error::Config(format!(
                "{} is in use by another twig-vmm",
                path.display()
            )));
        }
        std::fs::remove_file(path)
            .map_err(|e| Error::io(format!("removing stale socket {}", path.display()), e))?;
    }
    UnixListener::bind(path).map_err(|e| Error::io(format!("binding {}", path.display()), e))
}
