//! The template cache: the node's base templates, one per offered shape
//! (each built once on first need with `twig-vmm template`, named by the
//! digest of its inputs and shape so that new inputs make a new one) and
//! the app templates `EnsureTemplate` put in the
//! node store. Every template handed out is checked first: its `state`
//! parses and its shape is what the VM will be.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use sha2::{Digest, Sha256};
use twig_store::{layout, NodeStore, VmSnapshot};

use crate::config::Config;
use crate::error::{Error, Result};

/// The prefix of a base template's id: `base-<16 hex digits of the digest
/// of its inputs and shape>`.
pub const BASE_PREFIX: &str = "base-";

/// The shape of a VM: what a `twig-vmm serve --prepare-…` process was made
/// for, and what a template restores into.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shape {
    /// Guest RAM, MiB.
    pub mem_mib: u32,
    /// vCPUs.
    pub vcpus: u32,
    /// Empty disk slots.
    pub disk_slots: u32,
}

impl Shape {
    /// The shape a request names: its RAM and vCPUs, each 0 meaning
    /// `default`'s, with `default`'s disk slots.
    pub fn asked(default: Shape, mem_mib: u32, vcpus: u32) -> Shape {
        let or = |asked: u32, default: u32| if asked == 0 { default } else { asked };
        Shape {
            mem_mib: or(mem_mib, default.mem_mib),
            vcpus: or(vcpus, default.vcpus),
            disk_slots: default.disk_slots,
        }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} MiB × {} vCPU × {} disk slots",
            self.mem_mib, self.vcpus, self.disk_slots
        )
    }
}

/// A template ready to restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRef {
    /// Its id in the node store.
    pub id: String,
    /// Its snapshot directory.
    pub dir: PathBuf,
    /// The VM it restores into.
    pub shape: Shape,
}

/// What identifies the base template's input files without reading them:
/// (size, mtime ns, inode) of the kernel and the initrd.
type Stamp = [(u64, i64, u64); 2];

/// The node's templates.
pub struct Templates {
    store: NodeStore,
    config: Config,
    /// The digest of the base templates' input files (every shape's id
    /// continues it with the shape), and what they were when hashed.
    inputs: Mutex<Option<(Stamp, Sha256)>>,
}

impl Templates {
    /// Opens (creating if needed) the node store of `config`.
    pub fn open(config: &Config) -> Result<Templates> {
        let store = NodeStore::open(&config.store, config.allow_copy)?;
        Ok(Templates {
            store,
            config: config.clone(),
            inputs: Mutex::new(None),
        })
    }

    /// The node store.
    pub fn store(&self) -> &NodeStore {
        &self.store
    }

    /// The default shape: pods without limits get it (`base.mem_mib` ×
    /// `base.vcpus`).
    pub fn default_shape(&self) -> Shape {
        self.shape(self.config.base.mem_mib, self.config.base.vcpus)
    }

    /// Every base template shape the node offers, smallest first.
    pub fn offered(&self) -> Vec<Shape> {
        self.config
            .base
            .offered()
            .into_iter()
            .map(|(m, v)| self.shape(m, v))
            .collect()
    }

    /// What a pod's VM needs beyond its memory limit, MiB.
    pub fn guest_reserve_mib(&self) -> u32 {
        self.config.base.guest_reserve_mib
    }

    fn shape(&self, mem_mib: u32, vcpus: u32) -> Shape {
        Shape {
            mem_mib,
            vcpus,
            disk_slots: self.config.disk_slots,
        }
    }

    /// The id of the base template of `shape` for the current inputs:
    /// `base-<digest>`. The inputs are hashed only when their size, mtime
    /// or inode changed.
    pub fn base_id(&self, shape: Shape) -> Result<String> {
        let b = &self.config.base;
        let mut stamp = [(0, 0, 0); 2];
        for (i, input) in [&b.kernel, &b.initrd].into_iter().enumerate() {
            let m = std::fs::metadata(input).map_err(|e| {
                Error::FailedPrecondition(format!(
                    "the base template cannot be made: its input {} is unreadable: {e}",
                    input.display()
                ))
            })?;
            stamp[i] = (m.len(), m.mtime() * 1_000_000_000 + m.mtime_nsec(), m.ino());
        }
        let mut h = {
            let mut cached = self.inputs.lock().unwrap_or_else(|p| p.into_inner());
            match cached.as_ref() {
                Some((s, h)) if *s == stamp => h.clone(),
                _ => {
                    let mut h = Sha256::new();
                    h.update(b"twig base template v4 (MP table, TSC-deadline timer)\0");
                    for input in [&b.kernel, &b.initrd] {
                        hash_file(&mut h, input)?;
                    }
                    *cached = Some((stamp, h.clone()));
                    h
                }
            }
        };
        h.update(
            format!(
                "{}/{}/{}/{}",
                shape.mem_mib,
                shape.vcpus,
                shape.disk_slots,
                if self.config.free_page_reporting {
                    "balloon"
                } else {
                    "no balloon"
                }
            )
            .as_bytes(),
        );
        let digest = h.finalize();
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        Ok(format!("{BASE_PREFIX}{hex}"))
    }

    /// The base template of `shape` (one the node offers, else
    /// `INVALID_ARGUMENT` naming them), built first if the store does not
    /// hold the one of the current inputs. Builds are serialised across
    /// processes by a `flock` on `<store>/base.lock` (several daemons may
    /// share a store); a failed build publishes nothing. Once a new base is
    /// published, the base templates of no offered shape and the current
    /// inputs are deleted (unless a snapshot was taken on top of them).
    /// Blocking: call it on a blocking thread.
    pub fn base(&self, shape: Shape) -> Result<TemplateRef> {
        self.base_with(shape, |id| Ok(self.store.delete(id)?))
    }

    /// [`Templates::base`], deleting previous base templates with `delete`
    /// (the daemon's: refused while a running VM was restored from one).
    pub fn base_with(
        &self,
        shape: Shape,
        delete: impl Fn(&str) -> Result<()>,
    ) -> Result<TemplateRef> {
        let offered = self.offered();
        if !offered.contains(&shape) {
            return Err(Error::InvalidArgument(format!(
                "{shape} is not a VM shape of this node; it offers {}",
                list(&offered)
            )));
        }
        let id = self.base_id(shape)?;
        if let Ok(s) = self.store.get(&id) {
            return self.checked(&s, Some(shape));
        }
        let lock_path = self.config.store.join("base.lock");
        let lock = File::create(&lock_path)
            .map_err(|e| Error::io(format!("creating {}", lock_path.display()), e))?;
        twig_store::fsops::flock(&lock)
            .map_err(|e| Error::io(format!("locking {}", lock_path.display()), e))?;
        if let Ok(s) = self.store.get(&id) {
            return self.checked(&s, Some(shape));
        }
        self.build_base(&id, shape)?;
        let s = self.store.get(&id)?;
        let current = offered
            .iter()
            .map(|s| self.base_id(*s))
            .collect::<Result<Vec<_>>>()?;
        for old in self.store.list()? {
            if old.id.starts_with(BASE_PREFIX) && !current.contains(&old.id) {
                match delete(&old.id) {
                    Ok(()) => tracing::info!(id = old.id, "deleted a previous base template"),
                    Err(e) => tracing::warn!(id = old.id, "keeping a previous base template: {e}"),
                }
            }
        }
        self.checked(&s, Some(shape))
    }

    fn build_base(&self, id: &str, shape: Shape) -> Result<()> {
        let b = &self.config.base;
        if !self.config.vmm_binary.exists() {
            return Err(Error::FailedPrecondition(format!(
                "the base template cannot be made: {} is missing",
                self.config.vmm_binary.display()
            )));
        }
        let run = &self.config.run_dir;
        std::fs::create_dir_all(run)
            .map_err(|e| Error::io(format!("creating {}", run.display()), e))?;
        let vsock = run.join("template.vsock");
        let serial = run.join("template-serial.log");
        let _ = std::fs::remove_file(&vsock);
        let _ = std::fs::remove_file(&serial);
        tracing::info!(id, kernel = %b.kernel.display(), initrd = %b.initrd.display(), %shape, "building the base template");
        let started = std::time::Instant::now();
        let out = Command::new(&self.config.vmm_binary)
            .arg("template")
            .arg(self.store.snapshot_dir(id))
            .arg("--kernel")
            .arg(&b.kernel)
            .arg("--initrd")
            .arg(&b.initrd)
            .args(["--mem-mib", &shape.mem_mib.to_string()])
            .args(["--vcpus", &shape.vcpus.to_string()])
            .args(["--disk-slots", &shape.disk_slots.to_string()])
            // Every pod's VM has a network device, attached to its pod's tap
            // after restore: the template has it (detached) too.
            .arg("--net")
            .args(self.config.free_page_reporting.then_some("--balloon"))
            .args(["--timeout-s", &b.build_timeout_s.to_string()])
            .arg("--serial")
            .arg(&serial)
            .arg("--vsock-uds")
            .arg(&vsock)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| {
                Error::io(
                    format!("running {} template", self.config.vmm_binary.display()),
                    e,
                )
            })?;
        let _ = std::fs::remove_file(&vsock);
        if !out.status.success() {
            return Err(Error::Internal(format!(
                "building the base template {id} from {} and {} failed ({}): {} [guest console: {}]",
                b.kernel.display(),
                b.initrd.display(),
                out.status,
                tail(&String::from_utf8_lossy(&out.stderr)),
                tail(&String::from_utf8_lossy(
                    &std::fs::read(&serial).unwrap_or_default()
                )),
            )));
        }
        tracing::info!(id, elapsed = ?started.elapsed(), "base template built");
        Ok(())
    }

    /// Snapshot `name` of the node store (an app template, or a pod
    /// snapshot a clone restores), checked; its shape is its own.
    pub fn app(&self, name: &str) -> Result<TemplateRef> {
        layout::validate_id(name)?;
        let s = self.store.get(name).map_err(|e| match e {
            twig_store::Error::NotFound(_) => Error::NotFound(format!(
                "template {name:?} is not in this node's store ({}); EnsureTemplate makes it",
                self.config.store.display()
            )),
            other => other.into(),
        })?;
        self.checked(&s, None)
    }

    /// Snapshot `s`, staged and not yet published (a lazy restore's), as
    /// a template to restore: its directory and shape.
    pub fn staged(&self, s: &VmSnapshot) -> Result<TemplateRef> {
        self.checked(s, None)
    }

    /// `s` as a template, once its state parses and its shape is `expect`
    /// (if given): a damaged template is refused here rather than in a
    /// pod's restore.
    fn checked(&self, s: &VmSnapshot, expect: Option<Shape>) -> Result<TemplateRef> {
        let state = twig_vmm::snapshot::read_state(s.dir()).map_err(|e| {
            Error::FailedPrecondition(format!("template {:?} is unusable: {e}", s.id))
        })?;
        let shape = Shape {
            mem_mib: u32::try_from(state.meta.mem_size >> 20).unwrap_or(u32::MAX),
            vcpus: u32::try_from(state.meta.vcpus).unwrap_or(u32::MAX),
            disk_slots: self.config.disk_slots,
        };
        if let Some(want) = expect {
            if want != shape {
                return Err(Error::FailedPrecondition(format!(
                    "template {:?} is {shape}, the node's configuration says {want}",
                    s.id
                )));
            }
        }
        Ok(TemplateRef {
            id: s.id.clone(),
            dir: s.dir().to_path_buf(),
            shape,
        })
    }
}

fn hash_file(h: &mut Sha256, path: &Path) -> Result<()> {
    let mut f =
        File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    h.update(b"\0");
    Ok(())
}

/// `shapes` as `256 MiB × 1 vCPU, 512 MiB × 2 vCPUs` (for messages).
pub fn list(shapes: &[Shape]) -> String {
    crate::config::list_shapes(
        &shapes
            .iter()
            .map(|s| (s.mem_mib, s.vcpus))
            .collect::<Vec<_>>(),
    )
}

/// The last lines of a log, on one line.
pub fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.trim().lines().collect();
    lines[lines.len().saturating_sub(12)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path, mem_mib: u32) -> Config {
        let mut c = Config {
            store: dir.join("store"),
            allow_copy: true,
            run_dir: dir.join("run"),
            ..Config::default()
        };
        c.base.kernel = dir.join("vmlinux");
        c.base.initrd = dir.join("initrd");
        c.base.mem_mib = mem_mib;
        c
    }

    #[test]
    fn the_base_template_id_follows_its_inputs() {
        let dir = tempfile::tempdir().unwrap();
        let c = config(dir.path(), 128);
        let t = Templates::open(&c).unwrap();
        let shape = t.default_shape();
        let e = t.base_id(shape).unwrap_err();
        assert!(
            matches!(e, Error::FailedPrecondition(_)) && e.to_string().contains("vmlinux"),
            "{e}"
        );

        std::fs::write(&c.base.kernel, b"kernel one").unwrap();
        std::fs::write(&c.base.initrd, b"initrd").unwrap();
        let first = t.base_id(shape).unwrap();
        assert!(first.starts_with(BASE_PREFIX) && first.len() == BASE_PREFIX.len() + 16);
        assert_eq!(t.base_id(shape).unwrap(), first, "stable");
        // Every shape its own id, from the same inputs.
        let shapes = t.offered();
        assert_eq!(shapes.len(), 4);
        let ids: std::collections::HashSet<String> =
            shapes.iter().map(|s| t.base_id(*s).unwrap()).collect();
        assert_eq!(ids.len(), 4, "{ids:?}");
        assert!(ids.contains(&first));

        // Rewritten with the same bytes (new mtime): same id.
        std::fs::remove_file(&c.base.kernel).unwrap();
        std::fs::write(&c.base.kernel, b"kernel one").unwrap();
        assert_eq!(t.base_id(shape).unwrap(), first);

        // New bytes (same size): a new id.
        std::fs::remove_file(&c.base.kernel).unwrap();
        std::fs::write(&c.base.kernel, b"kernel two").unwrap();
        let second = t.base_id(shape).unwrap();
        assert_ne!(second, first);

        // Another default shape: another id; the same shape the same id,
        // whichever is the default.
        let other = Templates::open(&config(dir.path(), 256)).unwrap();
        assert_ne!(other.base_id(other.default_shape()).unwrap(), second);
        assert_eq!(other.base_id(shape).unwrap(), second);
    }

    #[test]
    fn a_shape_not_offered_is_refused_naming_the_offered_ones() {
        let dir = tempfile::tempdir().unwrap();
        let t = Templates::open(&config(dir.path(), 128)).unwrap();
        let e = t
            .base(Shape {
                mem_mib: 384,
                vcpus: 1,
                disk_slots: 8,
            })
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_))
                && e.to_string().contains(
                    "384 MiB × 1 vCPU × 8 disk slots is not a VM shape of this node; it offers \
                     128 MiB × 1 vCPU, 512 MiB × 2 vCPUs, 1024 MiB × 2 vCPUs, 2048 MiB × 4 vCPUs"
                ),
            "{e}"
        );
    }
}
