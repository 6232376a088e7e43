//! The warm pool: `twig-vmm serve --prepare-mem-mib … --disk-slots …
//! --vsock-uds …` processes whose VM and memory slots exist before a pod
//! asks, kept per shape and refilled in the background. [`Pool::take`]
//! hands one over (or spawns one when the pool of that shape is empty);
//! from then on the caller owns the process. Every VMM is the daemon's
//! child: a task per VMM waits for its exit, reaps it (no zombies, whoever
//! killed it), removes its directory, and, for a pooled one, refills.
//!
//! Each VMM has a directory `<run_dir>/vms/<daemon pid>-<n>/`: `vm/` (the
//! VMM's own: API socket, vsock socket, console log; owned by the VMM's
//! user), `serial.log` (a link to `vm/serial.log`), `vmm.log` (its stderr),
//! `pid`, `handed` (with the owner's pid and start time, if it has one),
//! and, jailed, `jail/` (its root). A jailed VMM sees
//! `vm/` and the node store's `snapshots` (read-only; of it, it reads only
//! what it was granted) and `tmp` (staging) at their host paths, so the
//! paths in API calls mean the same inside and outside the jail.
//!
//! The jail (Firecracker's jailer is the model, through `twig-vmm serve
//! --jail`): the empty `jail/` as root, `jail.uid`/`jail.gid`, no
//! capabilities, `NoNewPrivs`, new mount and empty network namespaces (the
//! pod's tap arrives later by `attach_net`), with `new_pid_ns` PID 1 of a new
//! PID namespace (the pid handed over is its parent, which exits as the VMM
//! does), and the cgroup `<jail.cgroup>/<daemon pid>-<n>` of every
//! hierarchy. Its root holds `/dev/kvm`, its own `/proc`, `vm/`
//! (read-write), `<store>/snapshots` (read-only: a VMM cannot alter a
//! template another VM restores) and `<store>/tmp` (read-write; group
//! `jail.gid`, mode `1775`: staging directories, and the anonymous reflink
//! backup of a rootfs sent as a descriptor during a rollback).
//!
//! Binding at the same path lets the shim's restore, snapshot and rollback
//! calls and snapshot chains (parents found as sibling directories) work
//! unchanged. Container rootfs images are not known when a pooled VMM
//! starts and are not its user's, so they are never bound: the (root) shim
//! opens each and sends the descriptor (`attach_disk`, `SCM_RIGHTS`).
//! Descriptors for the snapshot files too were rejected: a restore follows
//! a chain of parents by id, and snapshots create and rename files; a
//! read-only bind protects as well with no change to the snapshot code.
//! Each VMM runs as a user id of its own (`jail.uid .. jail.uid +
//! jail.ids`, taken round the range and given back when it exited,
//! recorded in `uid`; a handed-over VMM of an earlier daemon keeps its
//! id), sharing the group: staging directories are 0700 and chowned to
//! their writer (twig-store, twig-vmm's client), so no VMM reads or
//! writes another's snapshot before it is published.
//!
//! Nor does it read another's published snapshot (memory images of other
//! tenants): published, a snapshot directory is root's and `0700`, its
//! files root's `0644` (not writable by any VMM), `snapshots/` `0711`
//! (entered by id, never listed), and each VMM user reads only what a
//! POSIX ACL entry on a snapshot's directory grants it (twig-store's
//! `grants` module, which records each user's grants in a ledger): at
//! hand-over, the snapshots it is
//! handed over for (`uses`: its template, for a clone the pod snapshot)
//! with every parent they name; at publish, the snapshot it wrote (the
//! store grants the staging directory's owner: a pod rolls back to its
//! own snapshots, and an incremental one reads its parent, which it
//! restored or wrote). Grants are taken back (those the user's ledger
//! names) when the VMM is reaped and again before a VMM runs as that user
//! (user ids go round), and at the daemon's start, by a walk of every
//! published snapshot, from every user of
//! the range no running VMM has (snapshots published open by an earlier
//! version are sealed then); see `pool/jail.rs`. ACLs were chosen over a
//! per-VMM mount view: the jail, the shim and the snapshot code stay as
//! they are (the bind, parents found as siblings by path), and publish —
//! done by the shim, which does not know the VMM's directory — needs to
//! know only the staging directory's owner; a mount view would need the
//! node to mount each newly published snapshot into its writer's view,
//! which only the shim sees happen. The store's filesystem must support
//! ACLs (ext4, XFS do). Limits: a staging directory that outlives its
//! writer (a shim publishing after its VMM died) is readable by the next
//! VMM of that user id until published or dropped, and, published while
//! that VMM runs, granted to it until it exits; rolling back a jailed
//! VM's rootfs by reflink needs the store and the images on one reflink
//! filesystem (otherwise the rollback is refused, naming both).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::template::{tail, Shape};

mod jail;

use jail::{jail_args, remove_cgroup, share_staging, Jail};
use twig_store::NodeStore;

/// A prepared VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vmm {
    /// Its pid (a child of the daemon).
    pub pid: u32,
    /// Its directory: `vm/` (`api.sock`, `vsock`, `serial.log`),
    /// `serial.log` (a link into `vm/`), `vmm.log`.
    pub dir: PathBuf,
    /// The VM's shape.
    pub shape: Shape,
    /// Its user id, jailed.
    uid: Option<u32>,
}

impl Vmm {
    /// The API socket.
    pub fn api_socket(&self) -> PathBuf {
        own_dir(&self.dir).join("api.sock")
    }

    /// The host side of the vsock device.
    pub fn vsock_socket(&self) -> PathBuf {
        own_dir(&self.dir).join("vsock")
    }
}

/// The directory of a VMM's own files (sockets, console log), bound into
/// its jail at the same path.
fn own_dir(dir: &Path) -> PathBuf {
    dir.join("vm")
}

/// What the pool holds of one shape.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Level {
    /// The shape.
    pub shape: Shape,
    /// How many the configuration asks for.
    pub target: usize,
    /// The prepared VMMs, the next to be taken first.
    pub ready: Vec<u32>,
    /// Being started.
    pub starting: usize,
}

#[derive(Default)]
struct State {
    ready: HashMap<Shape, VecDeque<Vmm>>,
    starting: HashMap<Shape, usize>,
    /// Handed-over VMMs still running: pid → the snapshots they restore
    /// (their template, and for a clone the pod snapshot).
    handed: HashMap<u32, Vec<String>>,
    /// VMMs started and not answering yet (killed by [`Pool::close`]).
    spawning: HashSet<u32>,
    /// VMMs whose exit is not handled yet (reaped, cgroup and directory
    /// removed).
    watched: HashSet<u32>,
    /// The jailed VMMs' user ids in use (a handed-over VMM of an earlier
    /// daemon keeps its own for this daemon's life).
    uids: HashSet<u32>,
    /// Where the search for a free user id starts: the ids go round, so
    /// one is reused as late as possible.
    next_uid: u32,
}

struct Inner {
    vmm_binary: PathBuf,
    /// Every VMM gets `--balloon` (free page reporting), as its templates.
    balloon: bool,
    vms_dir: PathBuf,
    jail: Option<Jail>,
    targets: BTreeMap<Shape, usize>,
    start_timeout: Duration,
    state: Mutex<State>,
    refill: Notify,
    seq: AtomicU64,
    closed: AtomicBool,
}

/// The pool of prepared VMMs. Cheap to clone; needs a tokio runtime.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

/// Pause after a failed start before the refill tries again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

impl Pool {
    /// A pool as `config` says, its VMMs in `<run_dir>/vms/`. Leftovers of
    /// an earlier daemon there (pooled VMMs nobody took) are killed and
    /// removed. Starts the background refill.
    pub fn start(config: &Config) -> Result<Pool> {
        let vms_dir = config.run_dir.join("vms");
        std::fs::create_dir_all(&vms_dir)
            .map_err(|e| Error::io(format!("creating {}", vms_dir.display()), e))?;
        let jail = config.jail.enabled.then(|| Jail {
            uid: config.jail.uid,
            ids: config.jail.ids,
            gid: config.jail.gid,
            new_pid_ns: config.jail.new_pid_ns,
            cgroup: (!config.jail.cgroup.as_os_str().is_empty())
                .then(|| config.jail.cgroup.clone()),
            cgroup_settings: config
                .jail
                .cgroup_settings
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            max_files: config.jail.max_files,
            snapshots: config.store.join("snapshots"),
            staging: config.store.join("tmp"),
            store: config.store.clone(),
        });
        if let Some(j) = &jail {
            for d in [&j.snapshots, &j.staging] {
                std::fs::create_dir_all(d)
                    .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
            }
            share_staging(&j.staging, j.gid)?;
        }
        let kept_uids = remove_leftovers(&vms_dir, jail.as_ref().and_then(|j| j.cgroup.as_deref()));
        if let Some(j) = &jail {
            // Grants an earlier daemon left to users no VMM runs as now.
            j.forget_grants(&kept_uids)?;
        }
        let targets = config
            .pool
            .shapes
            .iter()
            .map(|s| {
                (
                    Shape {
                        mem_mib: s.mem_mib,
                        vcpus: s.vcpus,
                        disk_slots: config.disk_slots,
                    },
                    s.size,
                )
            })
            .collect();
        let pool = Pool {
            inner: Arc::new(Inner {
                vmm_binary: config.vmm_binary.clone(),
                balloon: config.free_page_reporting,
                vms_dir,
                jail,
                targets,
                start_timeout: Duration::from_secs(config.pool.start_timeout_s),
                state: Mutex::new(State {
                    uids: kept_uids,
                    ..State::default()
                }),
                refill: Notify::new(),
                seq: AtomicU64::new(0),
                closed: AtomicBool::new(false),
            }),
        };
        tokio::spawn(pool.clone().refill_loop());
        pool.inner.refill.notify_one();
        Ok(pool)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The level of every configured shape.
    pub fn levels(&self) -> Vec<Level> {
        let s = self.state();
        self.inner
            .targets
            .iter()
            .map(|(&shape, &target)| Level {
                shape,
                target,
                ready: s
                    .ready
                    .get(&shape)
                    .map(|q| q.iter().map(|v| v.pid).collect())
                    .unwrap_or_default(),
                starting: s.starting.get(&shape).copied().unwrap_or(0),
            })
            .collect()
    }

    /// The handed-over VMMs still running.
    pub fn handed(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.state().handed.keys().copied().collect();
        pids.sort_unstable();
        pids
    }

    /// The handed-over VMMs still running that were given the snapshot
    /// `id` (as their template, or to restore a clone from).
    pub fn users_of(&self, id: &str) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .state()
            .handed
            .iter()
            .filter(|(_, uses)| uses.iter().any(|u| u == id))
            .map(|(p, _)| *p)
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Hands over a prepared VMM of `shape` for the snapshots `uses` (its
    /// template, and for a clone the pod snapshot: none of them can be
    /// deleted while it runs): from the pool if it holds one (`true`), else
    /// started now (`false`). With an `owner`, the VMM is killed when that
    /// process exits.
    pub async fn take(
        &self,
        shape: Shape,
        uses: &[String],
        owner: Option<&Owner>,
    ) -> Result<(Vmm, bool)> {
        loop {
            let taken = {
                let mut s = self.state();
                let vmm = s.ready.get_mut(&shape).and_then(VecDeque::pop_front);
                if let Some(v) = &vmm {
                    s.handed.insert(v.pid, uses.to_vec());
                }
                vmm
            };
            let Some(vmm) = taken else { break };
            self.inner.refill.notify_one();
            // Killed while pooled, and its exit not handled yet: skip it
            // (its watcher reaps it and removes its directory).
            if is_alive(vmm.pid) {
                self.grant(&vmm, uses)?;
                hand_over(&vmm, owner)?;
                return Ok((vmm, true));
            }
            tracing::warn!(pid = vmm.pid, "a pooled VMM died before it was taken");
            self.state().handed.remove(&vmm.pid);
        }
        let vmm = self.spawn(shape, Some(uses)).await?;
        self.grant(&vmm, uses)?;
        hand_over(&vmm, owner)?;
        Ok((vmm, false))
    }

    /// Lets a jailed VMM read the snapshots it is handed over for and their
    /// parents; killed if that fails (nobody owns it yet, its watcher
    /// reaps it).
    fn grant(&self, vmm: &Vmm, uses: &[String]) -> Result<()> {
        match (&self.inner.jail, vmm.uid) {
            (Some(jail), Some(uid)) => jail.grant(uid, uses).inspect_err(|_| kill(vmm.pid)),
            _ => Ok(()),
        }
    }

    /// Lets VMM `vmm`, just handed over, read snapshot `id` staged in
    /// `dir` of `store` (described, not yet published: a lazy restore),
    /// and counts `id` among the snapshots it uses, so it is not deleted
    /// while the VMM runs once published. Kills the VMM if that fails.
    pub fn use_staged(&self, vmm: &Vmm, store: &NodeStore, dir: &Path, id: &str) -> Result<()> {
        if let (Some(_), Some(uid)) = (&self.inner.jail, vmm.uid) {
            store
                .grant_staged(dir, uid)
                .inspect_err(|_| kill(vmm.pid))?;
        }
        if let Some(uses) = self.state().handed.get_mut(&vmm.pid) {
            uses.push(id.to_string());
        }
        Ok(())
    }

    /// Takes back what user `uid` was granted (see [`Jail::revoke`]).
    fn revoke(&self, uid: Option<u32>) -> Result<()> {
        match (&self.inner.jail, uid) {
            (Some(jail), Some(uid)) => jail.revoke(uid),
            _ => Ok(()),
        }
    }

    /// Stops the refill and kills the pooled VMMs and those being started
    /// (handed-over ones belong to their shims and keep running).
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        let doomed: Vec<u32> = {
            let mut s = self.state();
            let mut pids: Vec<u32> = s
                .ready
                .drain()
                .flat_map(|(_, q)| q)
                .map(|v| v.pid)
                .collect();
            pids.extend(s.spawning.iter().copied());
            pids
        };
        for pid in doomed {
            kill(pid);
        }
        self.inner.refill.notify_one();
    }

    /// After [`Pool::close`]: waits up to `within` until every VMM it
    /// killed (and every handed-over one that exited) is reaped and its
    /// cgroup and directory are removed.
    pub async fn closed(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            // Handed-over VMMs run on, but one that exited is being
            // cleaned up: wait for that too.
            let left = {
                let s = self.state();
                s.watched
                    .iter()
                    .filter(|p| !s.handed.contains_key(p) || !is_alive(**p))
                    .count()
            };
            if left == 0 {
                return;
            }
            if Instant::now() >= deadline {
                tracing::warn!("{left} killed VMMs not reaped within {within:?}");
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn refill_loop(self) {
        loop {
            self.inner.refill.notified().await;
            if self.inner.closed.load(Ordering::SeqCst) {
                return;
            }
            for (&shape, &target) in &self.inner.targets {
                let missing = {
                    let mut s = self.state();
                    let have = s.ready.get(&shape).map_or(0, VecDeque::len)
                        + s.starting.get(&shape).copied().unwrap_or(0);
                    let missing = target.saturating_sub(have);
                    *s.starting.entry(shape).or_default() += missing;
                    missing
                };
                for _ in 0..missing {
                    let pool = self.clone();
                    tokio::spawn(async move { pool.fill_one(shape).await });
                }
            }
        }
    }

    async fn fill_one(&self, shape: Shape) {
        let started = Instant::now();
        let result = self.spawn(shape, None).await;
        let failed = {
            let mut s = self.state();
            if let Some(n) = s.starting.get_mut(&shape) {
                *n = n.saturating_sub(1);
            }
            match result {
                Ok(vmm) if self.inner.closed.load(Ordering::SeqCst) => {
                    kill(vmm.pid);
                    None
                }
                Ok(vmm) => {
                    tracing::debug!(pid = vmm.pid, %shape, elapsed = ?started.elapsed(), "pooled a prepared VMM");
                    s.ready.entry(shape).or_default().push_back(vmm);
                    None
                }
                Err(e) => Some(e),
            }
        };
        if let Some(e) = failed {
            tracing::warn!(%shape, "starting a pooled VMM failed (retrying in {RETRY_AFTER:?}): {e}");
            tokio::time::sleep(RETRY_AFTER).await;
            self.inner.refill.notify_one();
        }
    }

    /// Starts `twig-vmm serve` for `shape` and waits until its API answers.
    /// `handed`: the snapshots of a VMM started for a request (it is
    /// handed over as soon as it answers), `None` for a pooled one.
    async fn spawn(&self, shape: Shape, handed: Option<&[String]>) -> Result<Vmm> {
        let n = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-{n}", std::process::id());
        let dir = self.inner.vms_dir.join(&name);
        let own = own_dir(&dir);
        let uid = self.take_uid()?;
        // Whatever an earlier VMM of this user was granted since it exited
        // (a snapshot published after its VMM died).
        let started = self
            .revoke(uid)
            .and_then(|()| self.prepare(shape, &dir, &name, uid))
            .and_then(|mut cmd| {
                cmd.spawn().map_err(|e| {
                    Error::io(format!("starting {}", self.inner.vmm_binary.display()), e)
                })
            });
        let mut child = started.inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&dir);
            self.release_uid(uid);
        })?;
        let Some(pid) = child.id() else {
            let _ = std::fs::remove_dir_all(&dir);
            self.release_uid(uid);
            return Err(Error::Internal("twig-vmm exited at once".into()));
        };
        let (exited_tx, mut exited) = watch::channel(None);
        let pool = self.clone();
        let watched_dir = dir.clone();
        let cgroup = self.vmm_cgroup(&name);
        self.state().watched.insert(pid);
        tokio::spawn(async move {
            let status = child.wait().await;
            let text = match &status {
                Ok(s) => s.to_string(),
                Err(e) => format!("unknown status ({e})"),
            };
            let _ = exited_tx.send(Some(text.clone()));
            if let Some(cg) = cgroup {
                remove_cgroup(&cg).await;
            }
            pool.exited(pid, &watched_dir, &text);
            if let Err(e) = pool.revoke(uid) {
                tracing::warn!(pid, "taking back an exited VMM's grants: {e}");
            }
            pool.release_uid(uid);
            pool.state().watched.remove(&pid);
        });
        // Killed if this future fails or is dropped before the VMM answers
        // (a request whose deadline passed): nobody would own it otherwise.
        let mut guard = KillGuard {
            pool: self,
            pid,
            armed: true,
        };
        {
            let mut s = self.state();
            s.spawning.insert(pid);
            if let Some(uses) = handed {
                s.handed.insert(pid, uses.to_vec());
            }
        }
        // `close` sets the flag before it looks at `spawning`, this inserted
        // before it looks at the flag: one of the two sees the other.
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(Error::FailedPrecondition("the daemon is stopping".into()));
        }
        std::fs::write(dir.join("pid"), pid.to_string())
            .map_err(|e| Error::io(format!("writing {}/pid", dir.display()), e))?;
        let api = own.join("api.sock");
        let vmm = Vmm {
            pid,
            dir,
            shape,
            uid,
        };
        let deadline = Instant::now() + self.inner.start_timeout;
        loop {
            if let Some(status) = exited.borrow_and_update().clone() {
                // Reaped already: its pid may be another process's now.
                guard.armed = false;
                return Err(Error::Internal(format!(
                    "twig-vmm ({shape}) exited with {status} before it answered: {}",
                    tail(&String::from_utf8_lossy(
                        &std::fs::read(vmm.dir.join("vmm.log")).unwrap_or_default()
                    ))
                )));
            }
            if answers(&api).await {
                guard.armed = false;
                return Ok(vmm);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout(format!(
                    "twig-vmm ({shape}) did not answer on {} within {:?}",
                    api.display(),
                    self.inner.start_timeout
                )));
            }
            // Woken by the exit, or after a short pause to look again.
            let _ = tokio::time::timeout(Duration::from_millis(2), exited.changed()).await;
        }
    }

    /// A user id of its own for a new jailed VMM (`None` unjailed): the
    /// next free one of the range after the last taken.
    fn take_uid(&self) -> Result<Option<u32>> {
        let Some(jail) = &self.inner.jail else {
            return Ok(None);
        };
        let mut s = self.state();
        for i in 0..jail.ids {
            let k = (s.next_uid + i) % jail.ids;
            let uid = jail.uid + k;
            if s.uids.insert(uid) {
                s.next_uid = (k + 1) % jail.ids;
                return Ok(Some(uid));
            }
        }
        Err(Error::FailedPrecondition(format!(
            "all {} VMM user ids (jail.uid {} and up, jail.ids) are in use",
            jail.ids, jail.uid
        )))
    }

    /// Gives a VMM's user id back once it exited.
    fn release_uid(&self, uid: Option<u32>) {
        if let Some(uid) = uid {
            self.state().uids.remove(&uid);
        }
    }

    /// Makes the directory `dir` (named `name`) of a VMM of `shape` and
    /// returns the command that starts it there (jailed, as `uid`).
    fn prepare(
        &self,
        shape: Shape,
        dir: &Path,
        name: &str,
        uid: Option<u32>,
    ) -> Result<tokio::process::Command> {
        let own = own_dir(dir);
        let io = |what: &str, p: &Path| {
            let what = format!("{what} {}", p.display());
            move |e| Error::io(what, e)
        };
        std::fs::create_dir_all(&own).map_err(io("creating", &own))?;
        let log_path = dir.join("vmm.log");
        let log = std::fs::File::create(&log_path).map_err(io("creating", &log_path))?;
        // Where the shim and the daemon read the guest console.
        let serial_link = dir.join("serial.log");
        std::os::unix::fs::symlink("vm/serial.log", &serial_link)
            .map_err(io("linking", &serial_link))?;
        let mut cmd = tokio::process::Command::new(&self.inner.vmm_binary);
        cmd.arg("serve")
            .arg("--api-sock")
            .arg(own.join("api.sock"))
            .arg("--serial")
            .arg(own.join("serial.log"))
            .args(["--prepare-mem-mib", &shape.mem_mib.to_string()])
            .args(["--prepare-vcpus", &shape.vcpus.to_string()])
            .args(["--disk-slots", &shape.disk_slots.to_string()])
            // A network device with no tap: the shim sends the pod's tap
            // (`attach_net`) after the restore.
            .arg("--net")
            .args(self.inner.balloon.then_some("--balloon"))
            .arg("--vsock-uds")
            .arg(own.join("vsock"));
        if let (Some(jail), Some(uid)) = (&self.inner.jail, uid) {
            jail_args(&mut cmd, jail, uid, dir, name)?;
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        Ok(cmd)
    }

    /// The cgroup of the VMM whose directory is `name`, if VMMs get one.
    fn vmm_cgroup(&self, name: &str) -> Option<PathBuf> {
        let jail = self.inner.jail.as_ref()?;
        Some(jail.cgroup.as_ref()?.join(name))
    }

    /// A VMM exited (and was reaped): forget it, remove its directory, and
    /// refill if it was a pooled one.
    fn exited(&self, pid: u32, dir: &Path, status: &str) {
        let pooled = {
            let mut s = self.state();
            let handed = s.handed.remove(&pid).is_some();
            let mut pooled = false;
            for q in s.ready.values_mut() {
                let before = q.len();
                q.retain(|v| v.pid != pid);
                pooled |= q.len() != before;
            }
            if handed {
                tracing::info!(pid, status, "a handed-over VMM exited");
            }
            pooled
        };
        if let Err(e) = std::fs::remove_dir_all(dir) {
            tracing::warn!(dir = %dir.display(), "removing a VMM's directory: {e}");
        }
        if pooled {
            tracing::warn!(pid, status, "a pooled VMM exited; refilling");
            self.inner.refill.notify_one();
        }
    }
}

/// Kills a VMM being started unless disarmed (its watcher reaps it), and
/// takes it off the pool's `spawning` list either way.
struct KillGuard<'a> {
    pool: &'a Pool,
    pid: u32,
    armed: bool,
}

impl Drop for KillGuard<'_> {
    fn drop(&mut self) {
        self.pool.state().spawning.remove(&self.pid);
        if self.armed {
            kill(self.pid);
        }
    }
}

/// The process a handed-over VMM belongs to (its shim), held by a pidfd
/// so that its pid cannot be mistaken for a later process's.
#[derive(Debug)]
pub struct Owner {
    pid: u32,
    start_time: u64,
    pidfd: OwnedFd,
}

impl Owner {
    /// Opens the running process `pid`; an error when it does not run.
    pub fn open(pid: u32) -> std::io::Result<Owner> {
        // Opened before the start time is read: the pidfd names this very
        // process whatever happens to the pid later.
        let pidfd = open_pidfd(pid)?;
        let start_time = start_time(pid).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("process {pid} exited"),
            )
        })?;
        Ok(Owner {
            pid,
            start_time,
            pidfd,
        })
    }

    /// The owner `handed` names (`<pid> <start time>`) if it still runs as
    /// that same process; `Ok(None)` if it is gone, `Err` if the file names
    /// no owner.
    fn recorded(handed: &str) -> std::result::Result<Option<Owner>, ()> {
        let mut fields = handed.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(pid)), Some(Ok(start))) = (fields.next(), fields.next()) else {
            return Err(());
        };
        let pid = u32::try_from(pid).map_err(|_| ())?;
        Ok(Owner::open(pid).ok().filter(|o| o.start_time == start))
    }
}

/// The start time of `pid` (clock ticks since boot: `/proc/<pid>/stat`'s
/// 22nd field), which tells a process from a later one with its pid.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised name start with the 3rd.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Marks a VMM's directory as handed over, so that a later daemon's start
/// leaves the process (a shim's) alone, records its owner and starts
/// watching it.
fn hand_over(vmm: &Vmm, owner: Option<&Owner>) -> Result<()> {
    let record = owner
        .map(|o| format!("{} {}\n", o.pid, o.start_time))
        .unwrap_or_default();
    std::fs::write(vmm.dir.join(HANDED), record)
        .map_err(|e| Error::io(format!("writing {}/{HANDED}", vmm.dir.display()), e))?;
    if let Some(owner) = owner {
        // The VMM is this daemon's child and not reaped yet: the pidfd
        // names it.
        let vmm_fd =
            open_pidfd(vmm.pid).map_err(|e| Error::io(format!("pidfd of VMM {}", vmm.pid), e))?;
        let owner_fd = owner
            .pidfd
            .try_clone()
            .map_err(|e| Error::io(format!("pidfd of owner {}", owner.pid), e))?;
        tokio::spawn(kill_with_owner(owner_fd, owner.pid, vmm_fd, vmm.pid));
    }
    Ok(())
}

/// Waits until the process `owner_fd` exits, then kills the VMM `vmm_fd`
/// (nothing if it already exited).
async fn kill_with_owner(owner_fd: OwnedFd, owner: u32, vmm_fd: OwnedFd, vmm: u32) {
    if let Err(e) = exited(owner_fd).await {
        tracing::warn!(owner, vmm, "watching a VMM's owner: {e}");
        return;
    }
    if sigkill_pidfd(&vmm_fd) {
        tracing::warn!(
            owner,
            vmm,
            "the owner of a handed-over VMM exited; VMM killed"
        );
    }
}

/// Waits until the process behind `pidfd` exits.
async fn exited(pidfd: OwnedFd) -> std::io::Result<()> {
    use tokio::io::Interest;
    // SAFETY: the AsyncFd owns `pidfd` (an OwnedFd), which stays open and
    // the same descriptor until the AsyncFd is dropped.
    let registered =
        unsafe { tokio::io::unix::AsyncFd::register_with_interest(pidfd, Interest::READABLE) };
    match registered {
        Ok(fd) => fd.readable().await.map(drop),
        Err(e) => Err(e.into_parts().1),
    }
}

/// The marker file of a handed-over VMM's directory.
const HANDED: &str = "handed";

/// The file in a jailed VMM's directory holding its user id.
const UID: &str = "uid";

/// Whether a twig-vmm API answers on `api` (a connection and `hello`).
async fn answers(api: &Path) -> bool {
    if !api.exists() {
        return false;
    }
    let api = api.to_path_buf();
    tokio::task::spawn_blocking(move || {
        twig_vmm::api::Client::connect(&api, Duration::from_secs(1)).is_ok()
    })
    .await
    .unwrap_or(false)
}

/// Whether `pid` runs (exists and is no zombie).
fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

pub(crate) fn kill(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) with a pid of our own child; no memory is involved.
    if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
        tracing::debug!(pid, "kill: {}", std::io::Error::last_os_error());
    }
}

/// Kills and removes what an earlier daemon left in `vms_dir`: each
/// directory's `pid`, if that process still runs twig-vmm on that directory
/// and was not handed over. A handed-over VMM is a shim's: it runs on, and
/// its directory and cgroup are removed once it exited (watched through a
/// pidfd: it is not this daemon's child). Returns the user ids of those
/// that run on.
fn remove_leftovers(vms_dir: &Path, cgroup: Option<&Path>) -> HashSet<u32> {
    let mut kept = HashSet::new();
    let Ok(entries) = std::fs::read_dir(vms_dir) else {
        return kept;
    };
    for dir in entries.flatten().map(|e| e.path()) {
        let cg = cgroup.zip(dir.file_name()).map(|(cg, name)| cg.join(name));
        let pid = std::fs::read_to_string(dir.join("pid"))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok());
        if let Some(pid) = pid {
            // Opened before the check, so the pid cannot be another
            // process's by the time it is watched.
            let pidfd = open_pidfd(pid);
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let api = own_dir(&dir).join("api.sock");
            if String::from_utf8_lossy(&cmdline).contains(&*api.to_string_lossy()) {
                if let Ok(handed) = std::fs::read_to_string(dir.join(HANDED)) {
                    if let Some(uid) = std::fs::read_to_string(dir.join(UID))
                        .ok()
                        .and_then(|u| u.trim().parse().ok())
                    {
                        kept.insert(uid);
                    }
                    match pidfd {
                        Ok(fd) => {
                            watch_owner_again(&handed, &fd, pid);
                            tokio::spawn(clean_up_after(fd, pid, dir, cg));
                        }
                        Err(e) => tracing::warn!(pid, "watching a handed-over VMM: {e}"),
                    }
                    continue;
                }
                tracing::info!(pid, dir = %dir.display(), "killing a VMM an earlier daemon left");
                kill(pid);
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), "removing a leftover VMM directory: {e}");
        }
        if let Some(cg) = cg {
            // Empty once the killed VMM is gone (or already).
            tokio::spawn(async move { remove_cgroup(&cg).await });
        }
    }
    kept
}

fn open_pidfd(pid: u32) -> std::io::Result<OwnedFd> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new
    // descriptor or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: `fd` is a descriptor pidfd_open just returned, owned by
    // nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A handed-over VMM of an earlier daemon (`vmm_fd`) whose `handed`
/// record names an owner: watched again while the owner runs, killed now
/// if it is gone.
fn watch_owner_again(handed: &str, vmm_fd: &OwnedFd, vmm: u32) {
    let vmm_fd = match vmm_fd.try_clone() {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(vmm, "pidfd of a handed-over VMM: {e}");
            return;
        }
    };
    match Owner::recorded(handed) {
        // Handed over without an owner: its shim stops it.
        Err(()) => {}
        Ok(Some(owner)) => {
            tokio::spawn(kill_with_owner(owner.pidfd, owner.pid, vmm_fd, vmm));
        }
        Ok(None) => {
            tracing::warn!(vmm, "the owner of a handed-over VMM is gone; killing it");
            sigkill_pidfd(&vmm_fd);
        }
    }
}

/// Sends SIGKILL to the process behind `pidfd`; whether it was sent (not:
/// the process already exited).
fn sigkill_pidfd(pidfd: &OwnedFd) -> bool {
    // SAFETY: pidfd_send_signal(2) on an open pidfd, with no siginfo; no
    // memory is passed.
    let sent = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            std::os::fd::AsRawFd::as_raw_fd(pidfd),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    sent == 0
}

/// Waits until the handed-over VMM of an earlier daemon (its `pidfd`)
/// exits, then removes its cgroup and directory.
async fn clean_up_after(pidfd: OwnedFd, pid: u32, dir: PathBuf, cgroup: Option<PathBuf>) {
    if let Err(e) = exited(pidfd).await {
        tracing::warn!(pid, "watching a handed-over VMM: {e}");
        return;
    }
    tracing::info!(pid, "a handed-over VMM of an earlier daemon exited");
    if let Some(cg) = cgroup {
        remove_cgroup(&cg).await;
    }
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        tracing::warn!(dir = %dir.display(), "removing a VMM's directory: {e}");
    }
}
