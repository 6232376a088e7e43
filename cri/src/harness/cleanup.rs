//! Teardown: pods through CRI first (so CNI releases addresses and netns),
//! then whatever a dead or stuck containerd left, found by what is ours —
//! runc's state dir, shims started with our socket, mounts under our dir.

use super::run;
use crate::CriClient;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// How long teardown through CRI may take in all.
const CRI_TEARDOWN: Duration = Duration::from_secs(60);

/// Stops and removes every pod sandbox through CRI. Runs on its own thread
/// and runtime, so it works from sync code and from inside a tokio runtime.
pub(super) fn remove_pods(socket: &Path) {
    let socket = socket.to_path_buf();
    let worker = std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => return tracing::warn!(%e, "no runtime for CRI teardown"),
        };
        rt.block_on(async {
            let teardown = async {
                let client = CriClient::connect(&socket)
                    .await?
                    .with_timeout(Duration::from_secs(20));
                for pod in client.list_pod_sandboxes().await? {
                    if let Err(e) = client.stop_pod_sandbox(&pod.id).await {
                        tracing::warn!(%e, pod = pod.id, "teardown");
                    }
                    if let Err(e) = client.remove_pod_sandbox(&pod.id).await {
                        tracing::warn!(%e, pod = pod.id, "teardown");
                    }
                }
                Ok::<_, crate::Error>(())
            };
            match tokio::time::timeout(CRI_TEARDOWN, teardown).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(%e, "CRI teardown"),
                Err(_) => tracing::warn!("CRI teardown did not finish within {CRI_TEARDOWN:?}"),
            }
        });
    });
    let _ = worker.join();
}

/// Kills and deletes every container runc still knows under `root`.
pub(super) fn kill_runc_containers(root: &Path) {
    if !root.exists() {
        return;
    }
    let runc = |args: &[&str]| {
        run(
            Command::new("runc").arg("--root").arg(root).args(args),
            Duration::from_secs(10),
        )
    };
    let ids = match runc(&["list", "-q"]) {
        Ok(out) => out,
        Err(e) => return tracing::warn!(%e, "listing leftover containers"),
    };
    for id in ids.lines().filter(|l| !l.is_empty()) {
        tracing::warn!(id, "container left behind; killing it");
        let _ = runc(&["kill", "--all", id, "KILL"]);
        if let Err(e) = runc(&["delete", "--force", id]) {
            tracing::warn!(%e, "deleting a leftover container");
        }
    }
}

/// SIGKILLs every containerd shim started with `socket` as its containerd
/// address (shims outlive containerd by design).
pub(super) fn kill_shims(socket: &Path) {
    let Ok(procs) = fs::read_dir("/proc") else {
        return;
    };
    let needle = socket.as_os_str().as_encoded_bytes();
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let mut args = cmdline.split(|b| *b == 0);
        let is_shim = args
            .next()
            .is_some_and(|argv0| argv0.windows(15).any(|w| w == b"containerd-shim"));
        if is_shim && args.any(|a| a == needle) {
            tracing::warn!(pid, "shim left behind; killing it");
            // SAFETY: kill(2) on a PID just read from /proc whose command
            // line names our own containerd socket.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Lazily unmounts everything mounted under `dir`, deepest first.
pub(super) fn unmount_under(dir: &Path) {
    let Ok(mountinfo) = fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<String> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_octal)
        .filter(|p| Path::new(p).starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        tracing::warn!(mount = p, "mount left behind; detaching it");
        let _ = run(
            Command::new("umount").args(["-l", &p]),
            Duration::from_secs(10),
        );
    }
}

/// Undoes mountinfo's `\040`-style escapes.
fn unescape_octal(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let code = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0')));
        match code.and_then(|c| u8::try_from(c).ok()) {
            Some(c) => {
                out.push(c);
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::unescape_octal;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_octal(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape_octal(r"/plain\09"), r"/plain\09");
    }
}
