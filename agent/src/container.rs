//! Containers and their processes.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use oci_spec::runtime::{Process as OciProcess, Spec};

use crate::cgroup::Cgroup;
use crate::error::{AgentError, Result};
use crate::helper::{ExecTask, HelperTask, InitTask};
use crate::reaper::{lock, Exit, ExitCell, Reaper};
use crate::spawn::{spawn, ChildStdio};
use crate::spec::NamespacePlan;
use crate::stdio::{console_socket, pipe, recv_fd, set_nonblocking, OutputBuffer};

/// How long RemoveContainer waits for killed processes to be reaped.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// One process of a container (its init or an exec).
pub struct Process {
    /// Pid in the VM.
    pub pid: i32,
    /// Its exit, once reaped.
    pub exit: Arc<ExitCell>,
    /// Where to write its input; `None` once closed.
    pub stdin: Mutex<Option<OwnedFd>>,
    /// Its output (for a TTY: the terminal's output).
    pub stdout: Arc<OutputBuffer>,
    /// Its error output (closed and empty for a TTY).
    pub stderr: Arc<OutputBuffer>,
    /// The pty master, for a TTY process.
    pub tty: Option<OwnedFd>,
    /// Its container's cgroup, and its OOM kills when this process started.
    pub oom: Option<(Arc<Cgroup>, u64)>,
}

impl Process {
    /// Its exit status, if it has exited.
    pub fn exited(&self) -> Option<Exit> {
        self.exit.get()
    }

    /// Whether the container's memory limit OOM-killed a process of it
    /// since this process started.
    pub fn oom_killed(&self) -> bool {
        self.oom
            .as_ref()
            .is_some_and(|(cgroup, base)| cgroup.oom_kills() > *base)
    }
}

/// Lifecycle of a container.
pub enum State {
    /// Mounted and validated, init not started.
    Created,
    /// Init started.
    Started(Arc<Process>),
}

/// A container.
pub struct Container {
    /// Its id.
    pub id: String,
    /// Where its rootfs is mounted (agent's view).
    pub rootfs: PathBuf,
    /// Its state directory (holds `rootfs`).
    pub dir: PathBuf,
    /// The validated spec.
    pub spec: Spec,
    /// Init's state.
    pub state: State,
    /// Exec'd processes by exec id.
    pub execs: HashMap<String, Arc<Process>>,
    /// Whether init has its own pid namespace.
    pub own_pid_ns: bool,
    /// Its cgroup, when the VM has cgroup v2 (always in a Twig VM).
    pub cgroup: Option<Arc<Cgroup>>,
    /// A pod's sandbox container without a rootfs: its init is the
    /// agent's built-in pause (`rootfs` is not mounted).
    pub pause: bool,
    /// Its raw block volumes' device nodes.
    pub block_nodes: Vec<crate::devices::Node>,
    /// When its init started, in the agent's start order (0: not started):
    /// the pod's first app container is the one envd works in.
    pub start_order: u64,
}

/// The start order of the next container started.
static START_ORDER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A new process's stdio: the child's ends and the agent's.
struct NewStdio {
    child: ChildStdio,
    stdin: Option<OwnedFd>,
    stdout: Arc<OutputBuffer>,
    stderr: Arc<OutputBuffer>,
}

/// Pipes with their output drain threads started.
fn make_pipes(name: &str) -> Result<NewStdio> {
    let (in_r, in_w) = pipe()?;
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    set_nonblocking(in_w.as_fd())?;
    let stdout = Arc::new(OutputBuffer::default());
    stdout.drain(out_r, format!("{name}-out"));
    let stderr = Arc::new(OutputBuffer::default());
    stderr.drain(err_r, format!("{name}-err"));
    let child = ChildStdio {
        stdin: in_r,
        stdout: out_w,
        stderr: err_w,
    };
    Ok(NewStdio {
        child,
        stdin: Some(in_w),
        stdout,
        stderr,
    })
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd> {
    fd.try_clone()
        .map_err(|e| AgentError::sys("duplicating a stdio fd", e))
}

/// Starts the helper for `task`. A terminal process's helper gets one end
/// of a console socket as its stdio and sends back the pty master it opened
/// in the container (see `helper::open_console`).
fn start_process(
    reaper: &Reaper,
    task: &HelperTask,
    flags: CloneFlags,
    join_pid: Option<&Path>,
    terminal: bool,
    name: &str,
    cgroup: Option<&Arc<Cgroup>>,
) -> Result<Arc<Process>> {
    let oom = cgroup.map(|c| (c.clone(), c.oom_kills()));
    let cgroup = cgroup.map(|c| c.as_ref());
    if !terminal {
        let io = make_pipes(name)?;
        let spawned = spawn(reaper, task, flags, join_pid, io.child, cgroup)?;
        return Ok(Arc::new(Process {
            pid: spawned.pid,
            exit: spawned.exit,
            stdin: Mutex::new(io.stdin),
            stdout: io.stdout,
            stderr: io.stderr,
            tty: None,
            oom,
        }));
    }
    let (ours, theirs) = console_socket()?;
    let child = ChildStdio {
        stdin: dup(&theirs)?,
        stdout: dup(&theirs)?,
        stderr: theirs,
    };
    let spawned = spawn(reaper, task, flags, join_pid, child, cgroup)?;
    // The helper sent the master before it exec'd the process.
    let master = match recv_fd(ours.as_fd(), Duration::from_secs(5)) {
        Ok(m) => m,
        Err(e) => {
            let _ = kill(Pid::from_raw(spawned.pid), Signal::SIGKILL);
            return Err(e);
        }
    };
    set_nonblocking(master.as_fd())?;
    let stdin = dup(&master)?;
    let stdout = Arc::new(OutputBuffer::default());
    stdout.drain(dup(&master)?, format!("{name}-tty"));
    Ok(Arc::new(Process {
        pid: spawned.pid,
        exit: spawned.exit,
        stdin: Mutex::new(Some(stdin)),
        stdout,
        stderr: OutputBuffer::closed(),
        tty: Some(master),
        oom,
    }))
}

impl Container {
    /// Starts init.
    pub fn start(&mut self, reaper: &Reaper, no_pivot_root: bool) -> Result<u32> {
        if let State::Started(p) = &self.state {
            return Err(AgentError::FailedPrecondition(format!(
                "container {:?} is already started (init pid {})",
                self.id, p.pid
            )));
        }
        let plan = NamespacePlan::from_spec(&self.spec)?;
        let terminal = self
            .spec
            .process()
            .as_ref()
            .and_then(|p| p.terminal())
            .unwrap_or(false);
        let task = HelperTask::Init(Box::new(InitTask {
            rootfs: self.rootfs.clone(),
            spec: self.spec.clone(),
            join: plan.join.clone(),
            new_net: plan.new_net,
            no_pivot_root,
            pause: self.pause,
            block_nodes: self.block_nodes.clone(),
        }));
        let process = start_process(
            reaper,
            &task,
            plan.clone_flags,
            plan.join_pid.as_deref(),
            terminal,
            &self.id,
            self.cgroup.as_ref(),
        )?;
        let pid = process.pid;
        self.own_pid_ns = plan.clone_flags.contains(CloneFlags::CLONE_NEWPID);
        // As runc's shim does: a container that shares a pid namespace
        // (the pod's, with CRI's default) loses every other process when
        // its init exits, as one with its own namespace does by the
        // kernel's rule; otherwise an orphan holds its output open and
        // keeps running unseen.
        if !self.own_pid_ns {
            let (id, cgroup) = (self.id.clone(), self.cgroup.clone());
            process.exit.on_exit(move |_| {
                tracing::debug!(id, "init exited: killing the rest of the container");
                match cgroup {
                    Some(cgroup) => cgroup.kill_all(),
                    // No cgroup (an agent on a host, for tests): what
                    // stayed in init's session (execs have their own).
                    None => kill_session(pid),
                }
            });
        }
        self.state = State::Started(process);
        self.start_order = START_ORDER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(u32::try_from(pid).unwrap_or_default())
    }

    /// Runs another process in the started container.
    pub fn exec(&mut self, reaper: &Reaper, exec_id: &str, process: OciProcess) -> Result<u32> {
        let init = match &self.state {
            State::Started(p) => p.clone(),
            State::Created => {
                return Err(AgentError::FailedPrecondition(format!(
                    "container {:?} is not started",
                    self.id
                )))
            }
        };
        if init.exited().is_some() {
            return Err(AgentError::FailedPrecondition(format!(
                "container {:?}: its init process has exited",
                self.id
            )));
        }
        if self.pause {
            return Err(AgentError::FailedPrecondition(format!(
                "container {:?} is the pod's sandbox, whose init is the agent's built-in \
                 pause: it has no file system to run a process in",
                self.id
            )));
        }
        if self.execs.contains_key(exec_id) {
            return Err(AgentError::AlreadyExists(format!(
                "exec id {exec_id:?} already exists in container {:?}",
                self.id
            )));
        }
        let terminal = process.terminal().unwrap_or(false);
        let task = HelperTask::Exec(Box::new(ExecTask {
            init_pid: init.pid,
            process,
            seccomp: self.spec.linux().as_ref().and_then(|l| l.seccomp().clone()),
        }));
        let pid_ns = PathBuf::from(format!("/proc/{}/ns/pid", init.pid));
        let p = start_process(
            reaper,
            &task,
            CloneFlags::empty(),
            Some(&pid_ns),
            terminal,
            &format!("{}-{exec_id}", self.id),
            self.cgroup.as_ref(),
        )?;
        let pid = p.pid;
        self.execs.insert(exec_id.to_string(), p);
        Ok(u32::try_from(pid).unwrap_or_default())
    }

    /// Forgets the exited exec `exec_id`.
    pub fn remove_exec(&mut self, exec_id: &str) -> Result<()> {
        if exec_id.is_empty() {
            return Err(AgentError::InvalidArgument(format!(
                "container {:?}: the init process goes with RemoveContainer",
                self.id
            )));
        }
        let p = self.process(exec_id)?;
        if p.exited().is_none() {
            return Err(AgentError::FailedPrecondition(format!(
                "exec {exec_id:?} of container {:?} is running (pid {})",
                self.id, p.pid
            )));
        }
        self.execs.remove(exec_id);
        Ok(())
    }

    /// A process by exec id ("" = init).
    pub fn process(&self, exec_id: &str) -> Result<Arc<Process>> {
        if exec_id.is_empty() {
            return match &self.state {
                State::Started(p) => Ok(p.clone()),
                State::Created => Err(AgentError::FailedPrecondition(format!(
                    "container {:?} is not started",
                    self.id
                ))),
            };
        }
        self.execs.get(exec_id).cloned().ok_or_else(|| {
            AgentError::NotFound(format!("no exec {exec_id:?} in container {:?}", self.id))
        })
    }

    fn all_processes(&self) -> Vec<Arc<Process>> {
        let mut v: Vec<Arc<Process>> = self.execs.values().cloned().collect();
        if let State::Started(p) = &self.state {
            v.push(p.clone());
        }
        v
    }

    /// Pids (in the VM) of every live process of the container: everything
    /// in init's pid namespace if it has one, else the processes the agent
    /// started and their descendants.
    pub fn pids(&self) -> Vec<i32> {
        let table = proc_table();
        let roots: Vec<i32> = self
            .all_processes()
            .iter()
            .filter(|p| p.exited().is_none())
            .map(|p| p.pid)
            .collect();
        let mut pids: HashSet<i32> = HashSet::new();
        if self.own_pid_ns {
            if let State::Started(init) = &self.state {
                if let Some(ns) = pid_ns_of(init.pid) {
                    pids.extend(
                        table
                            .iter()
                            .filter(|e| pid_ns_of(e.pid).as_deref() == Some(ns.as_str()))
                            .map(|e| e.pid),
                    );
                }
            }
        }
        // Descendants of the started processes (covers execs and a
        // container without its own pid namespace).
        let mut frontier: Vec<i32> = roots
            .into_iter()
            .filter(|p| table.iter().any(|e| e.pid == *p))
            .collect();
        pids.extend(frontier.iter().copied());
        while let Some(p) = frontier.pop() {
            for e in table.iter().filter(|e| e.ppid == p) {
                if pids.insert(e.pid) {
                    frontier.push(e.pid);
                }
            }
        }
        let mut v: Vec<i32> = pids.into_iter().collect();
        v.sort_unstable();
        v
    }

    /// Memory and CPU of the container's processes.
    pub fn stats(&self) -> (u64, u64, u64, u32) {
        let table = proc_table();
        let pids = self.pids();
        // SAFETY: sysconf with constant names.
        let (page, hz) = unsafe {
            (
                libc::sysconf(libc::_SC_PAGESIZE).max(1) as u64,
                libc::sysconf(libc::_SC_CLK_TCK).max(1) as u64,
            )
        };
        let mut rss = 0u64;
        let mut utime = 0u64;
        let mut stime = 0u64;
        let mut count = 0u32;
        for e in table.iter().filter(|e| pids.contains(&e.pid)) {
            rss += e.rss_pages * page;
            utime += e.utime * 1_000_000 / hz;
            stime += e.stime * 1_000_000 / hz;
            count += 1;
        }
        (rss, utime, stime, count)
    }

    /// Kills every process and waits for them; unmounts the rootfs.
    pub fn remove(&mut self) -> Result<()> {
        let deadline = Instant::now() + KILL_TIMEOUT;
        for pid in self.pids() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        for p in self.all_processes() {
            let left = deadline.saturating_duration_since(Instant::now());
            if p.exited().is_none() {
                let _ = kill(Pid::from_raw(p.pid), Signal::SIGKILL);
                if p.exit.wait(left).is_none() {
                    return Err(AgentError::Internal(format!(
                        "container {:?}: process {} did not die within {KILL_TIMEOUT:?}",
                        self.id, p.pid
                    )));
                }
            }
        }
        unmount_rootfs(&self.rootfs)?;
        let _ = std::fs::remove_dir(&self.rootfs);
        let _ = std::fs::remove_dir(&self.dir);
        Ok(())
    }
}

/// Mounts `device` (ext4) at `target`.
pub fn mount_rootfs(device: &Path, target: &Path, read_only: bool) -> Result<()> {
    let mut flags = MsFlags::MS_NOATIME;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(Some(device), target, Some("ext4"), flags, None::<&str>).map_err(|e| {
        AgentError::InvalidArgument(format!(
            "mounting rootfs device {} (ext4{}) on {}: {e}",
            device.display(),
            if read_only { ", read-only" } else { "" },
            target.display()
        ))
    })
}

pub fn unmount_rootfs(target: &Path) -> Result<()> {
    match umount2(target, MntFlags::empty()) {
        Ok(()) | Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => Ok(()),
        Err(nix::errno::Errno::EBUSY) => umount2(target, MntFlags::MNT_DETACH)
            .map_err(|e| AgentError::sys(format!("unmounting {}", target.display()), e)),
        Err(e) => Err(AgentError::sys(
            format!("unmounting {}", target.display()),
            e,
        )),
    }
}

struct ProcEntry {
    pid: i32,
    ppid: i32,
    session: i32,
    utime: u64,
    stime: u64,
    rss_pages: u64,
}

/// SIGKILLs every process of session `sid`.
fn kill_session(sid: i32) {
    for e in proc_table().iter().filter(|e| e.session == sid) {
        let _ = kill(Pid::from_raw(e.pid), Signal::SIGKILL);
    }
}

fn proc_table() -> Vec<ProcEntry> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            parse_stat(pid, &stat)
        })
        .collect()
}

/// Parses /proc/<pid>/stat (the command may hold spaces and parentheses).
fn parse_stat(pid: i32, stat: &str) -> Option<ProcEntry> {
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state(0) ppid(1) pgrp(2) session(3) ... utime(11)
    // stime(12) ... rss(21)
    Some(ProcEntry {
        pid,
        ppid: f.get(1)?.parse().ok()?,
        session: f.get(3)?.parse().ok()?,
        utime: f.get(11)?.parse().ok()?,
        stime: f.get(12)?.parse().ok()?,
        rss_pages: f.get(21)?.parse().ok()?,
    })
}

fn pid_ns_of(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// All containers. An id maps to `None` while its container is being
/// created (the rootfs mount runs without the registry lock).
#[derive(Default)]
pub struct Registry {
    containers: Mutex<HashMap<String, Option<Arc<Mutex<Container>>>>>,
}

impl Registry {
    /// Looks a container up.
    pub fn get(&self, id: &str) -> Result<Arc<Mutex<Container>>> {
        match lock(&self.containers).get(id) {
            Some(Some(c)) => Ok(c.clone()),
            Some(None) => Err(AgentError::FailedPrecondition(format!(
                "container {id:?} is being created"
            ))),
            None => Err(AgentError::NotFound(format!("no container {id:?}"))),
        }
    }

    /// Reserves `id` (concurrent creates of one id fail), runs `make` and
    /// registers its container, or releases the id if it fails.
    pub fn insert_new(&self, id: &str, make: impl FnOnce() -> Result<Container>) -> Result<()> {
        {
            let mut map = lock(&self.containers);
            if map.contains_key(id) {
                return Err(AgentError::AlreadyExists(format!(
                    "container {id:?} already exists"
                )));
            }
            map.insert(id.to_string(), None);
        }
        match make() {
            Ok(c) => {
                lock(&self.containers).insert(id.to_string(), Some(Arc::new(Mutex::new(c))));
                Ok(())
            }
            Err(e) => {
                lock(&self.containers).remove(id);
                Err(e)
            }
        }
    }

    /// Every container created so far.
    pub fn all(&self) -> Vec<Arc<Mutex<Container>>> {
        lock(&self.containers).values().flatten().cloned().collect()
    }

    /// Forgets a container.
    pub fn remove(&self, id: &str) {
        lock(&self.containers).remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_handles_odd_names() {
        let s = "42 (a b) c)) S 7 42 42 0 -1 4194560 100 0 0 0 15 4 0 0 20 0 1 0 100 1000000 250 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";
        let e = parse_stat(42, s).unwrap();
        assert_eq!(
            (e.pid, e.ppid, e.utime, e.stime, e.rss_pages),
            (42, 7, 15, 4, 250)
        );
        assert!(parse_stat(1, "garbage").is_none());
    }

    #[test]
    fn own_process_is_in_the_table() {
        let me = std::process::id() as i32;
        let table = proc_table();
        let e = table.iter().find(|e| e.pid == me).unwrap();
        assert!(e.rss_pages > 0);
    }
}
