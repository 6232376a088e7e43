//! Guest volumes through the real client and agent binary (as root): a
//! kubelet-style ConfigMap volume updated live under a running container,
//! a sized tmpfs emptyDir, an emptyDir on the pod's disk, a
//! termination-message file read back, and the errors.

mod common;

use std::path::Path;

use common::{Agent, Image, T};
use serde_json::{json, Value};
use twig_agent::client::{AgentClient, Error};
use twig_agent::proto::agent::{PrepareVolumeRequest, VolumeEntry};
use twig_agent::testkit::spec;

fn entry(path: &str, mode: u32) -> VolumeEntry {
    VolumeEntry {
        path: path.to_string(),
        mode,
        ..Default::default()
    }
}

/// kubelet's AtomicWriter layout of `keys` in timestamped dir `ts`.
fn kubelet(ts: &str, keys: &[(&str, &str)]) -> Vec<VolumeEntry> {
    let mut d = entry(ts, 0o755);
    d.set_dir(true);
    let mut data = entry("..data", 0);
    data.set_symlink(ts.to_string());
    let mut v = vec![d, data];
    for (k, contents) in keys {
        let mut f = entry(&format!("{ts}/{k}"), 0o644);
        f.set_file(contents.as_bytes().to_vec());
        let mut l = entry(k, 0);
        l.set_symlink(format!("..data/{k}"));
        v.extend([f, l]);
    }
    v
}

fn prepare(c: &AgentClient, name: &str, tmpfs_bytes: u64, mode: u32) -> Result<(), Error> {
    let req = PrepareVolumeRequest {
        name: name.to_string(),
        tmpfs_bytes,
        mode,
        ..Default::default()
    };
    c.prepare_volume(&req, T)
}

fn code(r: Result<impl std::fmt::Debug, Error>) -> String {
    match r {
        Err(e) => e.status_code().unwrap_or("not a status").to_string(),
        Ok(v) => format!("ok: {v:?}"),
    }
}

fn bind(source: &Path, destination: &str, ro: bool) -> Value {
    let mut options = vec!["rbind"];
    if ro {
        options.push("ro");
    }
    json!({"destination": destination, "type": "bind", "source": source, "options": options})
}

#[test]
fn volumes_are_prepared_synced_read_and_removed() {
    let image = Image::new();
    let root = tempfile::tempdir().unwrap();
    let vols = root.path().join("volumes");
    let agent = Agent::start_with(&[], "", &["--volumes-dir", &common::path_str(&vols)]);
    let c = agent.client();

    prepare(&c, "cfg", 0, 0o755).unwrap();
    prepare(&c, "cfg", 0, 0o755).unwrap();
    prepare(&c, "cache", 1 << 20, 0o777).unwrap();
    prepare(&c, "term-app", 0, 0o700).unwrap();
    c.sync_volume("cfg", kubelet("..2026_01", &[("key", "v1\n")]), T)
        .unwrap();
    let mut term = entry("termination-log", 0o666);
    term.set_file(Vec::new());
    c.sync_volume("term-app", vec![term], T).unwrap();

    // The root and the sized volume are tmpfs mounts of the agent's.
    let mountinfo = agent.mountinfo();
    let tmpfs_at = |p: &Path| {
        mountinfo
            .lines()
            .any(|l| l.contains(&format!(" {} ", p.display())) && l.contains(" - tmpfs "))
    };
    assert!(tmpfs_at(&vols), "{mountinfo}");
    assert!(tmpfs_at(&vols.join("cache")), "{mountinfo}");
    assert!(!tmpfs_at(&vols.join("cfg")), "{mountinfo}");

    let mut s: Value = serde_json::from_slice(&spec(&["sleep", "1000"], json!({}))).unwrap();
    let mounts = s["mounts"].as_array_mut().unwrap();
    mounts.push(bind(&vols.join("cfg"), "/etc/config", true));
    mounts.push(bind(&vols.join("cache"), "/cache", false));
    mounts.push(bind(
        &vols.join("term-app/termination-log"),
        "/dev/termination-log",
        false,
    ));
    c.create_container("app", &image.device, false, s.to_string().as_bytes(), T)
        .unwrap();
    c.start_container("app", T).unwrap();
    let sh = |exec: &str, cmd: &str| {
        let (status, out, err) = c.run("app", exec, &["sh", "-c", cmd], T).unwrap();
        (
            status,
            String::from_utf8_lossy(&out).into_owned(),
            String::from_utf8_lossy(&err).into_owned(),
        )
    };

    // A ConfigMap update reaches the running container; the old
    // timestamped directory goes.
    assert_eq!(sh("v1", "cat /etc/config/key").1, "v1\n");
    c.sync_volume(
        "cfg",
        kubelet("..2026_02", &[("key", "v2\n"), ("more", "m\n")]),
        T,
    )
    .unwrap();
    assert_eq!(
        sh("v2", "cat /etc/config/key /etc/config/more").1,
        "v2\nm\n"
    );
    assert_eq!(
        sh("ls", "ls -A /etc/config").1,
        "..2026_02\n..data\nkey\nmore\n"
    );
    assert_ne!(sh("ro", "touch /etc/config/x 2>/dev/null").0, 0);

    // The emptyDir holds 1 MiB, then 4 after a resize; shrinking below
    // what it holds is refused, and so is turning it into a directory.
    let fill = "dd if=/dev/zero of=/cache/f bs=1024 count=2048 2>/dev/null";
    assert_ne!(sh("full", fill).0, 0);
    prepare(&c, "cache", 4 << 20, 0o777).unwrap();
    assert_eq!(sh("fits", fill).0, 0);
    assert_eq!(
        code(prepare(&c, "cache", 1 << 20, 0o777)),
        "FAILED_PRECONDITION"
    );
    assert_eq!(code(prepare(&c, "cache", 0, 0o777)), "FAILED_PRECONDITION");
    assert_eq!(
        code(prepare(&c, "cfg", 1 << 20, 0o755)),
        "FAILED_PRECONDITION"
    );

    // The termination message, written by a non-root process, comes back
    // bounded.
    let p = twig_agent::testkit::process(
        &["sh", "-c", "echo bye > /dev/termination-log"],
        json!({"user": {"uid": 1000, "gid": 1000}}),
    );
    c.exec_process("app", "term", &p, T).unwrap();
    assert_eq!(c.wait_exit("app", "term", T).unwrap().status, 0);
    let r = c
        .read_volume_file("term-app", "termination-log", 0, T)
        .unwrap();
    assert_eq!((r.data.as_slice(), r.truncated), (&b"bye\n"[..], false));
    let r = c
        .read_volume_file("term-app", "termination-log", 2, T)
        .unwrap();
    assert_eq!((r.data.as_slice(), r.truncated), (&b"by"[..], true));
    let r = c.read_volume_file("cfg", "key", 0, T).unwrap();
    assert_eq!(r.data, b"v2\n");

    // Refused: escapes, absolute paths, bad names; missing is NOT_FOUND.
    let mut up = entry("../x", 0o644);
    up.set_file(b"x".to_vec());
    assert_eq!(code(c.sync_volume("cfg", vec![up], T)), "INVALID_ARGUMENT");
    let mut abs = entry("/etc/passwd", 0o644);
    abs.set_file(b"x".to_vec());
    assert_eq!(code(c.sync_volume("cfg", vec![abs], T)), "INVALID_ARGUMENT");
    let mut out = entry("out", 0);
    out.set_symlink("../cache/f".to_string());
    assert_eq!(code(c.sync_volume("cfg", vec![out], T)), "INVALID_ARGUMENT");
    assert_eq!(code(prepare(&c, "..", 0, 0o755)), "INVALID_ARGUMENT");
    assert_eq!(
        code(c.read_volume_file("cfg", "../cache/f", 0, T)),
        "INVALID_ARGUMENT"
    );
    assert_eq!(code(c.read_volume_file("cfg", "nope", 0, T)), "NOT_FOUND");
    assert_eq!(code(c.read_volume_file("nope", "key", 0, T)), "NOT_FOUND");
    assert_eq!(code(c.sync_volume("nope", vec![], T)), "NOT_FOUND");
    // The refused syncs changed nothing.
    assert_eq!(sh("still", "cat /etc/config/key").1, "v2\n");

    // Removal: idempotent, and the container's bind mounts outlive it.
    c.remove_volume("cache", T).unwrap();
    c.remove_volume("cache", T).unwrap();
    let cache = format!(" {} ", vols.join("cache").display());
    assert!(!agent.mountinfo().contains(&cache));
    assert_eq!(sh("kept", "cat /etc/config/key").1, "v2\n");
    c.remove_container("app", T).unwrap();
    c.remove_volume("term-app", T).unwrap();
    c.remove_volume("cfg", T).unwrap();
    assert_eq!(code(c.read_volume_file("cfg", "key", 0, T)), "NOT_FOUND");
    let left = agent.mountinfo();
    assert!(
        !left.contains(&format!("{}/", vols.display())),
        "volume mounts left: {left}"
    );
}

fn prepare_on_disk(c: &AgentClient, name: &str, device: &str, bytes: u64) -> Result<(), Error> {
    let req = PrepareVolumeRequest {
        name: name.to_string(),
        mode: 0o777,
        device: device.to_string(),
        device_bytes: bytes,
        subdirs: vec!["sub/dir".into()],
        ..Default::default()
    };
    c.prepare_volume(&req, T)
}

#[test]
fn a_disk_backed_emptydir_lives_on_the_pods_disk() {
    let app = Image::new();
    let pod_disk = Image::new();
    let other = Image::new();
    let root = tempfile::tempdir().unwrap();
    let vols = root.path().join("volumes");
    let agent = Agent::start_with(&[], "", &["--volumes-dir", &common::path_str(&vols)]);
    let c = agent.client();
    prepare_on_disk(&c, "empty-dir~scratch", &pod_disk.device, 0).unwrap();
    // Again (a restarted container, a clone's adoption): the same volume.
    prepare_on_disk(&c, "empty-dir~scratch", &pod_disk.device, 0).unwrap();
    prepare_on_disk(&c, "empty-dir~other", &pod_disk.device, 0).unwrap();
    let mountinfo = agent.mountinfo();
    let ext4_at = |p: &Path| {
        mountinfo
            .lines()
            .any(|l| l.contains(&format!(" {} ", p.display())) && l.contains(" - ext4 "))
    };
    assert!(ext4_at(&root.path().join("pod-disk")), "{mountinfo}");
    assert!(ext4_at(&vols.join("empty-dir~scratch")), "{mountinfo}");

    let mut s: Value = serde_json::from_slice(&spec(&["sleep", "1000"], json!({}))).unwrap();
    let mounts = s["mounts"].as_array_mut().unwrap();
    mounts.push(bind(&vols.join("empty-dir~scratch"), "/scratch", false));
    c.create_container("app", &app.device, false, s.to_string().as_bytes(), T)
        .unwrap();
    c.start_container("app", T).unwrap();
    let (status, _, err) = c
        .run(
            "app",
            "w",
            &[
                "sh",
                "-c",
                "echo kept > /scratch/sub/dir/f && test -d /scratch/sub",
            ],
            T,
        )
        .unwrap();
    assert_eq!(status, 0, "{}", String::from_utf8_lossy(&err));
    c.remove_container("app", T).unwrap();
    // The file is on the pod's disk, in the volume's directory there (as
    // the agent's mount namespace sees it).
    let on_disk = format!(
        "/proc/{}/root{}/pod-disk/twig-volumes/empty-dir~scratch/sub/dir/f",
        agent.pid(),
        root.path().display()
    );
    assert_eq!(std::fs::read_to_string(&on_disk).unwrap(), "kept\n");

    // Refused: both a tmpfs and the disk; another disk; a directory volume
    // asked to move onto the disk and back; a device that is no disk.
    let mut both = PrepareVolumeRequest {
        name: "both".into(),
        tmpfs_bytes: 1 << 20,
        device: pod_disk.device.clone(),
        ..Default::default()
    };
    assert_eq!(code(c.prepare_volume(&both, T)), "INVALID_ARGUMENT");
    both.tmpfs_bytes = 0;
    both.device = "/dev/null".into();
    assert_eq!(code(c.prepare_volume(&both, T)), "INVALID_ARGUMENT");
    assert_eq!(
        code(prepare_on_disk(&c, "third", &other.device, 0)),
        "FAILED_PRECONDITION"
    );
    prepare(&c, "cfg", 0, 0o755).unwrap();
    assert_eq!(
        code(prepare_on_disk(&c, "cfg", &pod_disk.device, 0)),
        "FAILED_PRECONDITION"
    );
    assert_eq!(
        code(prepare(&c, "empty-dir~scratch", 0, 0o777)),
        "FAILED_PRECONDITION"
    );
    assert_eq!(
        code(prepare(&c, "empty-dir~scratch", 1 << 20, 0o777)),
        "FAILED_PRECONDITION"
    );
}

#[test]
fn prepare_volumes_makes_a_pods_volumes_in_one_call_and_names_the_one_that_fails() {
    let root = tempfile::tempdir().unwrap();
    let vols = root.path().join("volumes");
    let agent = Agent::start_with(&[], "", &["--volumes-dir", &common::path_str(&vols)]);
    let c = agent.client();
    let volume =
        |name: &str, tmpfs_bytes: u64, content: Option<Vec<VolumeEntry>>| PrepareVolumeRequest {
            name: name.into(),
            tmpfs_bytes,
            mode: 0o755,
            has_content: content.is_some(),
            entries: content.unwrap_or_default(),
            ..Default::default()
        };
    let cfg = kubelet("..2026_01", &[("key", "v1\n")]);
    c.prepare_volumes(
        vec![volume("cfg", 0, Some(cfg)), volume("cache", 1 << 20, None)],
        T,
    )
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(format!(
            "/proc/{}/root{}/cfg/key",
            agent.pid(),
            vols.display()
        ))
        .unwrap(),
        "v1\n",
        "the content came with it"
    );
    assert!(agent
        .mountinfo()
        .lines()
        .any(|l| l.contains(&format!(" {} ", vols.join("cache").display()))));

    // The second one is malformed: the first is made, the error names the
    // second, the third is not tried.
    let e = c
        .prepare_volumes(
            vec![
                volume("one", 0, None),
                volume("..", 0, None),
                volume("three", 0, None),
            ],
            T,
        )
        .unwrap_err();
    assert_eq!(e.status_code(), Some("INVALID_ARGUMENT"), "{e}");
    assert!(e.to_string().contains("volume .."), "{e}");
    let exists =
        |n: &str| Path::new(&format!("/proc/{}/root{}/{n}", agent.pid(), vols.display())).exists();
    assert!(exists("one") && !exists("three"));
    // Content for a file share is refused.
    let mut share = volume("s", 0, Some(Vec::new()));
    share.share = "0123456789abcdef0123456789abcdef".into();
    assert_eq!(code(c.prepare_volumes(vec![share], T)), "INVALID_ARGUMENT");
}
