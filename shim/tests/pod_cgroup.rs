//! The VMM's move into the pod's cgroup (`resources::cgroups::join`) on
//! this host's real cgroups (v1 hybrid or v2): a fake pod cgroup with a
//! small memory limit in a temporary subtree, a shell standing in for
//! twig-vmm and its PID namespace child, moved with every process below it
//! into the sandbox's cgroup, then bounded by the pod's limit, and the
//! sandbox's cgroup removed once its processes are gone. Needs root;
//! it fails, never skips, without it. The subtree is removed afterwards.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use twig_shim::error::Error;
use twig_shim::resources::cgroups;
use twig_vmm::jail::cgroup::{hierarchies, Hierarchy};

/// The pod's memory limit.
const LIMIT: u64 = 32 << 20;

/// The test's subtree (`/twig-test-<pid>-<name>`) in every hierarchy, and the
/// shell; the shell is killed and the subtree removed, deepest first, when
/// it is dropped.
struct Fixture {
    base: PathBuf,
    mounted: Vec<Hierarchy>,
    child: Option<Child>,
}

impl Fixture {
    fn new(name: &str) -> Fixture {
        Fixture {
            base: PathBuf::from(format!("twig-test-{}-{name}", std::process::id())),
            mounted: hierarchies().expect("the cgroup hierarchies"),
            child: None,
        }
    }

    /// Where the pod's memory limit goes: v1's memory hierarchy, else the
    /// v2 tree (its root enables the controller for its children).
    fn memory(&self) -> (&Hierarchy, bool) {
        if let Some(h) = self
            .mounted
            .iter()
            .find(|h| h.controllers.iter().any(|c| c == "memory"))
        {
            return (h, false);
        }
        let h = self
            .mounted
            .iter()
            .find(|h| h.v2)
            .expect("a memory hierarchy or cgroup v2");
        (h, true)
    }

    /// `/twig-test-<pid>-<name>/pod`, limited to [`LIMIT`] (no swap).
    fn pod(&self) -> PathBuf {
        let (h, v2) = self.memory();
        let pod = h.mount.join(&self.base).join("pod");
        if v2 {
            write(&h.mount.join("cgroup.subtree_control"), "+memory");
            std::fs::create_dir_all(h.mount.join(&self.base)).unwrap();
            write(
                &h.mount.join(&self.base).join("cgroup.subtree_control"),
                "+memory",
            );
            std::fs::create_dir_all(&pod).unwrap();
            write(&pod.join("memory.max"), &LIMIT.to_string());
            write(&pod.join("memory.swap.max"), "0");
        } else {
            std::fs::create_dir_all(&pod).unwrap();
            write(&pod.join("memory.limit_in_bytes"), &LIMIT.to_string());
            if pod.join("memory.memsw.limit_in_bytes").exists() {
                write(&pod.join("memory.memsw.limit_in_bytes"), &LIMIT.to_string());
            }
        }
        Path::new("/").join(&self.base).join("pod")
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            for p in descendants(c.id()).into_iter().rev() {
                // SAFETY: kill takes integers only.
                unsafe { libc::kill(p as i32, libc::SIGKILL) };
            }
            let _ = c.wait();
        }
        for h in &self.mounted {
            for dir in ["pod/sb", "pod", ""] {
                let path = h.mount.join(&self.base).join(dir);
                let deadline = Instant::now() + Duration::from_secs(5);
                while path.exists() && std::fs::remove_dir(&path).is_err() {
                    if Instant::now() > deadline {
                        eprintln!("could not remove {}", path.display());
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

fn write(path: &Path, value: &str) {
    std::fs::write(path, value).unwrap_or_else(|e| panic!("{value} > {}: {e}", path.display()));
}

/// `pid` and the processes below it (through `/proc/*/task/*/children`).
fn descendants(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    let mut i = 0;
    while let Some(&p) = all.get(i) {
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let children =
                    std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                all.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<u32>().ok()),
                );
            }
        }
        i += 1;
    }
    all
}

/// The cgroup of `pid` in each hierarchy, as `/proc/<pid>/cgroup` says.
fn cgroups_of(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn the_vmm_and_its_children_join_the_pod_cgroup_and_its_memory_limit_bounds_them() {
    let mut f = Fixture::new("bounded");
    let pod = f.pod();
    let sandbox = pod.join("sb");
    // The stand-in for twig-vmm: a shell whose subshell (its "PID
    // namespace child") grows a string once told to, until the pod's
    // memory limit kills it; the shell then says how it ended.
    let mut child = Command::new("sh")
        .args([
            "-c",
            "(read go; x=a; while :; do x=$x$x; done); echo sub $?",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    f.child = Some(child);
    let deadline = Instant::now() + Duration::from_secs(5);
    let tree = loop {
        let tree = descendants(pid);
        if tree.len() >= 2 {
            break tree;
        }
        assert!(Instant::now() < deadline, "the subshell did not start");
        std::thread::sleep(Duration::from_millis(5));
    };

    let started = Instant::now();
    cgroups::join(&sandbox, pid).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "join of {} processes into {} hierarchies: {:?}",
        tree.len(),
        f.mounted.len(),
        started.elapsed()
    );
    for p in &tree {
        let lines = cgroups_of(*p);
        assert_eq!(lines.len(), f.mounted.len(), "{lines:?}");
        for line in lines {
            assert!(
                line.ends_with(&format!(":{}", sandbox.display())),
                "pid {p} is not in {} everywhere: {line}",
                sandbox.display()
            );
        }
    }
    // Joining again (a VM restored into the same sandbox) is harmless.
    cgroups::join(&sandbox, pid).unwrap_or_else(|e| panic!("{e}"));

    stdin.write_all(b"go\n").unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "sub 137", "the subshell was not OOM-killed");
    let status = f.child.as_mut().unwrap().wait().unwrap();
    assert!(status.success(), "{status}");
    // The pod's usage went up to its limit and no further; the kill is
    // counted where v1 counts it (the task's group, the sandbox's) or in
    // v2's pod group (the sandbox's has no memory controller of its own).
    let (h, v2) = f.memory();
    let pod_dir = h.mount.join(pod.strip_prefix("/").unwrap());
    let read = |path: PathBuf| {
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let (peak, events) = if v2 {
        (
            pod_dir.join("memory.peak"),
            read(pod_dir.join("memory.events")),
        )
    } else {
        (
            pod_dir.join("memory.max_usage_in_bytes"),
            read(pod_dir.join("sb").join("memory.oom_control")),
        )
    };
    if peak.exists() {
        let peak: u64 = read(peak).trim().parse().unwrap();
        assert!(
            (LIMIT / 2..=LIMIT).contains(&peak),
            "the pod's peak usage {peak} is not up to its limit {LIMIT}"
        );
    }
    let kills: u64 = events
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no oom_kill count: {events}"));
    assert!(kills >= 1, "no OOM kill in the pod's cgroup: {events}");

    // The VMM gone, the sandbox's cgroup goes too, everywhere (kubelet
    // then removes the pod's); the pod's stays; again is no error.
    cgroups::remove(&sandbox).unwrap_or_else(|e| panic!("{e}"));
    let relative = sandbox.strip_prefix("/").unwrap();
    for h in &f.mounted {
        assert!(!h.mount.join(relative).exists(), "{}", h.mount.display());
        assert!(h.mount.join(relative.parent().unwrap()).exists());
    }
    cgroups::remove(&sandbox).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_sandbox_cgroup_with_a_live_process_is_not_removed() {
    let f = Fixture::new("busy");
    let sandbox = f.pod().join("sb");
    let mut sleeper = Killed(Command::new("sleep").arg("30").spawn().unwrap());
    cgroups::join(&sandbox, sleeper.0.id()).unwrap_or_else(|e| panic!("{e}"));
    let e = cgroups::remove(&sandbox).unwrap_err();
    assert!(
        matches!(e, Error::FailedPrecondition(_))
            && e.to_string().contains(&sandbox.display().to_string()),
        "{e}"
    );
    sleeper.0.kill().unwrap();
    sleeper.0.wait().unwrap();
    cgroups::remove(&sandbox).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_move_that_cannot_be_done_is_refused_naming_the_cgroup_and_the_file() {
    let f = Fixture::new("refused");
    let pod = f.pod();
    let mut sleeper = Killed(Command::new("sleep").arg("30").spawn().unwrap());
    let pid = sleeper.0.id();

    // A cgroup under a file: it cannot be created.
    let under_file = pod.join("cgroup.procs").join("sb");
    let e = cgroups::join(&under_file, pid).unwrap_err();
    assert!(
        matches!(e, Error::FailedPrecondition(_))
            && e.to_string().contains(&format!("pid {pid}"))
            && e.to_string().contains(&under_file.display().to_string())
            && e.to_string().contains("creating "),
        "{e}"
    );
    // A process that is gone.
    sleeper.0.kill().unwrap();
    sleeper.0.wait().unwrap();
    let e = cgroups::join(&pod.join("sb"), pid).unwrap_err();
    assert!(
        matches!(e, Error::FailedPrecondition(_))
            && e.to_string().contains(&format!("/proc/{pid}")),
        "{e}"
    );
}

/// A child killed when the test ends, passed or not.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
