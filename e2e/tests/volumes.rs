//! The files kubelet and CRI give a pod, through containerd's CRI plugin,
//! on twig and on runc (the reference), with the same observable results:
//! a ConfigMap volume in kubelet's atomic-writer layout (read-only, its
//! `..data` swap seen live within 10 s), an emptyDir shared by two
//! containers (on twig, on the pod's disk in the VM), kubelet's `/etc/hosts`, the cluster DNS `resolv.conf` CRI
//! writes from the sandbox's DNS config, and a termination message that
//! reaches kubelet's file on the host when the container exits; an
//! in-place resize (UpdateContainerResources) reaches the container's
//! cgroup (on twig, in the VM; beyond the VM it is refused). On twig, a
//! rollback rewinds the emptyDir but keeps the pod's current ConfigMap, a
//! clone sees its own ConfigMap in its adopted container, another
//! namespace's pod cannot restore the snapshot, and a hostPath file is
//! refused naming the mount. A host directory (hostPath, filesystem PVC) is
//! read and written from the container on both, the host's writes seen at
//! once, a read-only one refusing writes, a non-root container's files its
//! user's on the host; on twig, Snapshot and Rollback of its pod are
//! refused naming it and its file servers end with the pod. A raw block volume (kubelet's `volumeDevices`: a CRI
//! device of a block node; a loop device stands for the claim's device)
//! is read and written from the container on both; on twig, Snapshot and
//! Rollback of its pod are refused naming it. Built with `--features lab` and
//! run in the nested lab by `tests/lab/run.sh -p twig-e2e --features
//! twig-e2e/lab`.

use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use twig_agent::testkit::LoopDevice;
use twig_controller::crd::SnapshotMode;
use twig_controller::shim::{TtrpcShim, TwigShim};
use twig_cri::api;
use twig_cri::container_config;
use twig_e2e::cgroup::PodCgroup;
use twig_e2e::crilab::{runtime, wait_exited, CriLab, PROGRESS};
use twig_e2e::IMAGE_REF;
use twig_proto::contract::RESTORE_FROM_ANNOTATION;
use twig_shim::share_server::SERVE_ARG;
use twig_store::NodeStore;

/// How soon a ConfigMap edit must be seen in the container (the issue's
/// bound; kubelet itself takes up to a minute to write one).
const LIVE: Duration = Duration::from_secs(10);
/// Deadline of a snapshot or rollback call (TCG).
const CALL: Duration = Duration::from_secs(300);

/// kubelet's atomic writer, as it updates a volume: a new timestamped
/// directory, `..data` renamed over, the user-visible link, the old
/// directory removed.
fn write_atomic(volume: &Path, generation: u32, key: &str, value: &str) {
    let data = format!("..2026_11_28_{generation:02}");
    std::fs::create_dir_all(volume.join(&data)).expect("data dir");
    std::fs::write(volume.join(&data).join(key), value).expect("payload");
    let tmp = volume.join("..data_tmp");
    symlink(&data, &tmp).expect("..data_tmp");
    std::fs::rename(&tmp, volume.join("..data")).expect("..data swap");
    if !volume.join(key).exists() {
        symlink(format!("..data/{key}"), volume.join(key)).expect("key link");
    }
    if generation > 1 {
        let old = volume.join(format!("..2026_11_28_{:02}", generation - 1));
        std::fs::remove_dir_all(old).expect("old data dir");
    }
}

fn mount(container_path: &str, host_path: &Path, readonly: bool) -> api::Mount {
    api::Mount {
        container_path: container_path.into(),
        host_path: host_path.to_string_lossy().into_owned(),
        readonly,
        ..Default::default()
    }
}

struct KubeletPod {
    config: PathBuf,
    scratch: PathBuf,
    hosts: PathBuf,
    message: PathBuf,
}

/// A pod directory as kubelet lays it out under `root`.
fn kubelet_pod(root: &Path, uid: &str) -> KubeletPod {
    let pod = root.join("pods").join(uid);
    let config = pod.join("volumes/kubernetes.io~configmap/cfg");
    std::fs::create_dir_all(&config).expect("configmap dir");
    write_atomic(&config, 1, "greeting", "hello");
    let scratch = pod.join("volumes/kubernetes.io~empty-dir/scratch");
    std::fs::create_dir_all(&scratch).expect("emptyDir");
    let hosts = pod.join("etc-hosts");
    std::fs::write(
        &hosts,
        "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n10.1.2.3\tfoo.remote\n",
    )
    .expect("etc-hosts");
    let message = pod.join("containers/quitter/5f3a9c01");
    std::fs::create_dir_all(message.parent().expect("parent")).expect("containers dir");
    std::fs::write(&message, b"").expect("termination file");
    KubeletPod {
        config,
        scratch,
        hosts,
        message,
    }
}

fn volumes(handler: &str) {
    runtime().block_on(scenario(handler));
}

async fn scenario(handler: &str) {
    let lab = CriLab::start().await;
    let mut pod = lab
        .node
        .pod_config(&format!("vol-{handler}"))
        .unwrap_or_else(|e| panic!("{e}"));
    pod.dns_config = Some(api::DnsConfig {
        servers: vec!["10.96.0.10".into()],
        searches: vec![
            "team-a.svc.cluster.local".into(),
            "svc.cluster.local".into(),
        ],
        options: vec!["ndots:5".into()],
    });
    let uid = pod
        .metadata
        .as_ref()
        .map(|m| m.uid.clone())
        .unwrap_or_default();
    let k = kubelet_pod(&lab.dir().join("kubelet"), &uid);

    let mut app = container_config(
        "app",
        IMAGE_REF,
        &[
            "/bin/sh",
            "-c",
            "echo shared > /scratch/from-app; exec sleep 3600",
        ],
        "app.log",
    );
    app.mounts = vec![
        mount("/etc/config", &k.config, true),
        mount("/scratch", &k.scratch, false),
        mount("/etc/hosts", &k.hosts, false),
    ];
    let (pod_id, app_id) = lab.run_pod(&pod, handler, &app).await;

    // The ConfigMap, read-only; kubelet's hosts file; CRI's resolv.conf.
    assert_eq!(
        lab.exec(&app_id, &["cat", "/etc/config/greeting"]).await,
        (0, "hello".into())
    );
    let (code, _) = lab
        .exec(&app_id, &["sh", "-c", "echo x > /etc/config/new"])
        .await;
    assert_ne!(code, 0, "a ConfigMap volume is read-only");
    let (_, hosts) = lab.exec(&app_id, &["cat", "/etc/hosts"]).await;
    assert!(hosts.contains("10.1.2.3\tfoo.remote"), "{hosts}");
    let (_, resolv) = lab.exec(&app_id, &["cat", "/etc/resolv.conf"]).await;
    for line in [
        "nameserver 10.96.0.10",
        "search team-a.svc.cluster.local svc.cluster.local",
        "options ndots:5",
    ] {
        assert!(
            resolv.contains(line),
            "{line:?} not in resolv.conf:\n{resolv}"
        );
    }

    if handler == "twig" {
        // A disk-backed emptyDir is on the pod's disk in the VM, not in
        // guest memory.
        let (_, mounts) = lab.exec(&app_id, &["cat", "/proc/mounts"]).await;
        let scratch = mounts
            .lines()
            .find(|l| l.split(' ').nth(1) == Some("/scratch"))
            .unwrap_or_else(|| panic!("no /scratch in\n{mounts}"));
        assert!(
            scratch.starts_with("/dev/vd") && scratch.contains(" ext4 "),
            "{scratch}"
        );
    }

    // A ConfigMap edit (kubelet's atomic swap) reaches the container.
    write_atomic(&k.config, 2, "greeting", "bonjour");
    let edited = Instant::now();
    loop {
        let (_, now) = lab.exec(&app_id, &["cat", "/etc/config/greeting"]).await;
        if now == "bonjour" {
            break;
        }
        assert!(
            edited.elapsed() < LIVE,
            "the edit was not seen within {LIVE:?} (still {now:?})\n{}",
            lab.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "volumes[{handler}]: ConfigMap edit seen after {:?}",
        edited.elapsed()
    );

    resize(&lab, handler, &app_id).await;

    // A second container: the same emptyDir, and a termination message.
    let mut quitter = container_config(
        "quitter",
        IMAGE_REF,
        &[
            "/bin/sh",
            "-c",
            "cat /scratch/from-app > /dev/termination-log; echo ' and goodbye' >> \
             /dev/termination-log; exit 3",
        ],
        "quitter.log",
    );
    quitter.mounts = vec![
        mount("/scratch", &k.scratch, false),
        mount("/dev/termination-log", &k.message, false),
    ];
    let quitter_id = lab
        .cri
        .create_container(&pod_id, &quitter, &pod)
        .await
        .unwrap_or_else(|e| lab.fail("CreateContainer quitter", e));
    lab.cri
        .start_container(&quitter_id)
        .await
        .unwrap_or_else(|e| lab.fail("StartContainer quitter", e));
    let status = wait_exited(&lab.node, &lab.cri, &quitter_id, PROGRESS).await;
    assert_eq!(status.exit_code, 3, "{status:?}");
    let message = std::fs::read_to_string(&k.message).expect("the termination file");
    assert_eq!(
        message, "shared\n and goodbye\n",
        "kubelet's file on the host"
    );

    if handler == "twig" {
        // Only the running app: the exited container goes first (a
        // rollback keeps the pod's set of containers).
        lab.cri
            .remove_container(&quitter_id)
            .await
            .unwrap_or_else(|e| lab.fail("RemoveContainer quitter", e));
        snapshots(&lab, &pod, &pod_id, &app_id, &k).await;
        // CRI makes the task (the shim's Create) at StartContainer.
        let file = lab.dir().join("a-host-file");
        std::fs::write(&file, "x").expect("a host file");
        let mut host_path = container_config("hp", IMAGE_REF, &["true"], "hp.log");
        host_path.mounts = vec![mount("/srv/file", &file, false)];
        let hp = lab
            .cri
            .create_container(&pod_id, &host_path, &pod)
            .await
            .unwrap_or_else(|e| lab.fail("CreateContainer hp", e));
        let err = lab
            .cri
            .start_container(&hp)
            .await
            .err()
            .unwrap_or_else(|| panic!("a hostPath file was accepted by twig"));
        let text = err.to_string();
        assert!(
            text.contains("/srv/file") && text.contains("not a file"),
            "{text}"
        );
    }
    lab.remove_pod(&pod_id).await;
}

/// The container's memory limit as its cgroup says (`max`: none): its own
/// cgroup, below a cgroup namespace's root or not.
const MEMORY_MAX: &str = "p=$(sed -n 's/^0:://p' /proc/self/cgroup); \
     cat /sys/fs/cgroup${p%/}/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory.max";

/// kubelet's in-place resize (CRI's UpdateContainerResources) of a running
/// container: its new memory limit is its cgroup's, on twig inside the VM;
/// on twig a limit beyond the VM is refused naming the field.
async fn resize(lab: &CriLab, handler: &str, id: &str) {
    let update = |bytes: i64| {
        lab.cri.update_container_resources(
            id,
            api::LinuxContainerResources {
                memory_limit_in_bytes: bytes,
                ..Default::default()
            },
        )
    };
    let limit = 96 << 20;
    update(limit)
        .await
        .unwrap_or_else(|e| lab.fail("UpdateContainerResources", e));
    assert_eq!(
        lab.exec(id, &["sh", "-c", MEMORY_MAX]).await,
        (0, limit.to_string()),
        "the resized limit in {handler}'s container"
    );
    if handler == "twig" {
        let err = update(1 << 40)
            .await
            .err()
            .unwrap_or_else(|| panic!("a 1 TiB limit was accepted by twig"));
        let text = err.to_string();
        assert!(
            text.contains("resources.limits.memory") && text.contains("beyond the pod's VM"),
            "{text}"
        );
        assert_eq!(
            lab.exec(id, &["sh", "-c", MEMORY_MAX]).await,
            (0, limit.to_string()),
            "a refused resize changes nothing"
        );
    }
}

/// A unique snapshot id: the lab's nodes share one store.
fn snap_id(name: &str) -> String {
    format!("e2e-{}-{name}", std::process::id())
}

/// Waits until `cat path` in container `id` says `want`.
async fn until_seen(lab: &CriLab, id: &str, path: &str, want: &str) {
    let deadline = Instant::now() + PROGRESS;
    loop {
        let (_, now) = lab.exec(id, &["cat", path]).await;
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{path} of {id} is {now:?}, not {want:?}\n{}",
            lab.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Twig only: a rollback rewinds the emptyDir (it lives in the VM) but the
/// pod keeps its current ConfigMap; a clone (another pod, its own kubelet
/// directory) sees its own ConfigMap in the adopted container, not its
/// source's; a pod of another namespace cannot restore the snapshot.
async fn snapshots(
    lab: &CriLab,
    pod: &api::PodSandboxConfig,
    pod_id: &str,
    app_id: &str,
    k: &KubeletPod,
) {
    let sandbox = lab.sandbox_of(pod).await;
    assert_eq!(sandbox.id, pod_id);
    let shim = TtrpcShim { timeout: CALL };
    let snap = snap_id("volumes");
    shim.snapshot(&sandbox, &snap, SnapshotMode::Full)
        .await
        .unwrap_or_else(|e| panic!("snapshot: {e}\n{}", lab.logs()));
    let store = NodeStore::open(&lab.node.node().vm_store().expect("store"), false)
        .expect("the node store");
    assert_eq!(
        store.get(&snap).expect("the snapshot").owner.as_deref(),
        Some("default"),
        "the pod's namespace owns its snapshot"
    );

    // After the snapshot: the emptyDir changes, and so does the ConfigMap.
    let (code, _) = lab
        .exec(app_id, &["sh", "-c", "echo after > /scratch/from-app"])
        .await;
    assert_eq!(code, 0);
    write_atomic(&k.config, 3, "greeting", "hola");
    until_seen(lab, app_id, "/etc/config/greeting", "hola").await;
    shim.rollback(&sandbox, &snap, "volumes-op-1")
        .await
        .unwrap_or_else(|e| panic!("rollback: {e}\n{}", lab.logs()));
    assert_eq!(
        lab.exec(app_id, &["cat", "/scratch/from-app"]).await,
        (0, "shared".into()),
        "the emptyDir is the snapshot's again"
    );
    // The snapshot's copy said "bonjour"; the pod's ConfigMap says "hola".
    until_seen(lab, app_id, "/etc/config/greeting", "hola").await;

    // A clone: its own pod, UID and kubelet directory, its own ConfigMap.
    let mut clone = lab
        .node
        .pod_config("vol-clone")
        .unwrap_or_else(|e| panic!("{e}"));
    clone
        .annotations
        .insert(RESTORE_FROM_ANNOTATION.into(), snap.clone());
    let clone_uid = clone
        .metadata
        .as_ref()
        .map(|m| m.uid.clone())
        .unwrap_or_default();
    let ck = kubelet_pod(&lab.dir().join("kubelet"), &clone_uid);
    write_atomic(&ck.config, 2, "greeting", "the clone's own");
    let mut app = container_config(
        "app",
        IMAGE_REF,
        &["/bin/sh", "-c", "sleep 3600"],
        "app.log",
    );
    app.mounts = vec![
        mount("/etc/config", &ck.config, true),
        mount("/scratch", &ck.scratch, false),
        mount("/etc/hosts", &ck.hosts, false),
    ];
    let (clone_id, clone_app) = lab.run_pod(&clone, "twig", &app).await;
    until_seen(lab, &clone_app, "/etc/config/greeting", "the clone's own").await;
    assert_eq!(
        lab.exec(&clone_app, &["cat", "/scratch/from-app"]).await,
        (0, "shared".into()),
        "the clone carries the source's emptyDir"
    );
    lab.remove_pod(&clone_id).await;

    // Another namespace's pod naming the snapshot is refused.
    let mut foreign = lab
        .node
        .pod_config("vol-foreign")
        .unwrap_or_else(|e| panic!("{e}"));
    if let Some(m) = foreign.metadata.as_mut() {
        m.namespace = "team-b".into();
    }
    foreign
        .annotations
        .insert(RESTORE_FROM_ANNOTATION.into(), snap.clone());
    let text = match lab.cri.run_pod_sandbox(&foreign, "twig").await {
        Ok(id) => panic!("a pod of team-b restored default's snapshot: {id}"),
        Err(e) => e.to_string(),
    };
    assert!(text.contains("is owned by namespace \"default\""), "{text}");
    if let Err(e) = store.delete(&snap) {
        eprintln!("deleting snapshot {snap}: {e}");
    }
}

#[test]
fn twig_gives_a_pod_kubelets_files_and_volumes() {
    volumes("twig");
}

#[test]
fn runc_gives_a_pod_kubelets_files_and_volumes() {
    volumes("runc");
}

/// A host directory (a hostPath; a filesystem PVC is a directory kubelet
/// mounted on the host, the same to the runtime): read, written, renamed
/// and removed from the container, seen on the host at once and the
/// host's writes seen in the container; a read-only one refuses writes; a
/// file a non-root container creates belongs to its user on the host. On
/// twig, Snapshot and Rollback of its pod are refused naming it, its file
/// servers are charged to the pod's cgroup, and none outlives the pod.
fn host_dir(handler: &str) {
    runtime().block_on(host_dir_scenario(handler));
}

async fn host_dir_scenario(handler: &str) {
    let lab = CriLab::start().await;
    let data = lab.dir().join(format!("hostdir-{handler}"));
    let ro = lab.dir().join(format!("hostdir-ro-{handler}"));
    for d in [&data, &ro] {
        std::fs::create_dir_all(d).expect("a host directory");
        std::fs::write(d.join("hello"), "from the host\n").expect("a host file");
    }
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let cgroup = PodCgroup::new(&format!("twig-e2e-{}", std::process::id()), handler, None)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut pod = lab
        .node
        .pod_config(&format!("hostdir-{handler}"))
        .unwrap_or_else(|e| panic!("{e}"));
    pod.linux.get_or_insert_with(Default::default).cgroup_parent = cgroup.parent.clone();
    let mut app = container_config("app", IMAGE_REF, &["/bin/sleep", "3600"], "app.log");
    app.mounts = vec![mount("/data", &data, false), mount("/ro", &ro, true)];
    let (pod_id, id) = lab.run_pod(&pod, handler, &app).await;
    let (code, out) = lab
        .exec(
            &id,
            &[
                "sh",
                "-c",
                "cat /data/hello && echo from-the-guest > /data/new && mkdir -p /data/d/e \
                 && echo deep > /data/d/e/f && mv /data/new /data/moved && rm /data/hello \
                 && dd if=/dev/zero of=/data/big bs=64k count=64 2>/dev/null && sync",
            ],
        )
        .await;
    assert_eq!(
        (code, out.as_str()),
        (0, "from the host"),
        "{handler}: the host's file"
    );
    let read = |p: &str| std::fs::read_to_string(data.join(p)).unwrap_or_default();
    assert_eq!(read("moved"), "from-the-guest\n", "{handler}: renamed");
    assert_eq!(read("d/e/f"), "deep\n", "{handler}: a new tree");
    assert!(
        !data.join("hello").exists(),
        "{handler}: removed on the host"
    );
    let big = std::fs::metadata(data.join("big")).map(|m| m.len());
    assert_eq!(big.ok(), Some(4 << 20), "{handler}: 4 MiB written through");
    std::fs::write(data.join("late"), "written later\n").expect("a host write");
    let (code, out) = lab.exec(&id, &["cat", "/data/late"]).await;
    assert_eq!(
        (code, out.as_str()),
        (0, "written later"),
        "{handler}: the host's write seen at once"
    );
    let (code, out) = lab
        .exec(
            &id,
            &[
                "sh",
                "-c",
                "cat /ro/hello; echo x > /ro/new || echo refused",
            ],
        )
        .await;
    assert_eq!(
        (code, out.as_str()),
        (0, "from the host\nrefused"),
        "{handler}: read-only"
    );
    assert!(!ro.join("new").exists(), "{handler}: nothing written to ro");

    let mut user = container_config("user", IMAGE_REF, &["/bin/sleep", "3600"], "user.log");
    user.mounts = vec![mount("/data", &data, false)];
    if let Some(linux) = user.linux.as_mut() {
        linux.security_context = Some(api::LinuxContainerSecurityContext {
            run_as_user: Some(api::Int64Value { value: 1000 }),
            run_as_group: Some(api::Int64Value { value: 1001 }),
            ..Default::default()
        });
    }
    let user_id = lab.add_container(&pod_id, &pod, &user).await;
    let (code, out) = lab
        .exec(
            &user_id,
            &["sh", "-c", "echo mine > /data/mine && cat /data/d/e/f"],
        )
        .await;
    assert_eq!(
        (code, out.as_str()),
        (0, "deep"),
        "{handler}: the user reads and writes the host's files"
    );
    let mine = std::fs::metadata(data.join("mine")).expect("the user's file");
    assert_eq!(
        (mine.uid(), mine.gid()),
        (1000, 1001),
        "{handler}: owned by the container's user"
    );

    if handler == "twig" {
        let sandbox = lab.sandbox_of(&pod).await;
        let shim = TtrpcShim { timeout: CALL };
        let e = shim
            .snapshot(&sandbox, &snap_id("hostdir"), SnapshotMode::Full)
            .await
            .expect_err("a pod with a host directory is not snapshotted");
        assert!(e.to_string().contains("host directory"), "{e}");
        let e = shim
            .rollback(&sandbox, &snap_id("hostdir"), "hostdir-op-1")
            .await
            .expect_err("nor rolled back");
        assert!(e.to_string().contains("host directory"), "{e}");
        let (code, _) = lab.exec(&id, &["true"]).await;
        assert_eq!(code, 0, "the pod runs on");
        let servers = share_servers();
        assert_eq!(servers.len(), 3, "one server per mount");
        for pid in &servers {
            let at = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            assert!(
                at.lines()
                    .any(|l| l.starts_with("0::") && l[3..].starts_with(&cgroup.parent)),
                "file server {pid} is charged to the pod ({}): {at}",
                cgroup.parent
            );
        }
    }
    lab.remove_pod(&pod_id).await;
    let left = share_servers();
    assert!(left.is_empty(), "{handler}: file servers left: {left:?}");
    assert_eq!(
        read("moved"),
        "from-the-guest\n",
        "{handler}: the data stays"
    );
}

/// The file-share servers running (processes whose first argument is the
/// shim's serve mode).
fn share_servers() -> Vec<String> {
    processes(|proc| {
        let cmdline = std::fs::read(proc.join("cmdline")).unwrap_or_default();
        cmdline
            .split(|b| *b == 0)
            .nth(1)
            .is_some_and(|a| a == SERVE_ARG.as_bytes())
    })
}

#[test]
fn twig_shares_a_host_directory_and_refuses_to_snapshot_it() {
    host_dir("twig");
}

#[test]
fn runc_shares_a_host_directory() {
    host_dir("runc");
}

/// A raw block volume: kubelet maps a block-mode claim's device and passes
/// its node as a CRI device (`devicePath` in the container, `mrw`); here a
/// loop device over a file of the node stands for it.
fn block_volume(handler: &str) {
    runtime().block_on(block_scenario(handler));
}

async fn block_scenario(handler: &str) {
    let lab = CriLab::start().await;
    let img = lab.dir().join(format!("claim-{handler}.img"));
    let mut data = vec![0u8; 4 << 20];
    data[512..1024].fill(b'k');
    std::fs::write(&img, &data).expect("the claim's image");
    let dev = LoopDevice::new(&img).expect("a loop device for the claim");
    let pod = lab
        .node
        .pod_config(&format!("blk-{handler}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut db = container_config("db", IMAGE_REF, &["/bin/sleep", "3600"], "db.log");
    db.devices = vec![api::Device {
        container_path: "/dev/xvdb".into(),
        host_path: dev.0.display().to_string(),
        permissions: "mrw".into(),
    }];
    let (pod_id, id) = lab.run_pod(&pod, handler, &db).await;
    let (code, out) = lab
        .exec(
            &id,
            &[
                "sh",
                "-c",
                "test -b /dev/xvdb && dd if=/dev/xvdb bs=512 skip=1 count=1 2>/dev/null | head -c 4 \
                 && echo written | dd of=/dev/xvdb bs=512 seek=2 conv=notrunc,fsync 2>/dev/null",
            ],
        )
        .await;
    assert_eq!(
        (code, out.as_str()),
        (0, "kkkk"),
        "{handler}: the claim's bytes"
    );
    let on_disk = std::fs::read(&img).expect("the claim's image");
    assert_eq!(
        &on_disk[1024..1032],
        b"written\n",
        "{handler}: written through"
    );
    if handler == "twig" {
        let sandbox = lab.sandbox_of(&pod).await;
        let shim = TtrpcShim { timeout: CALL };
        let e = shim
            .snapshot(&sandbox, &snap_id("block"), SnapshotMode::Full)
            .await
            .expect_err("a pod with a raw block volume is not snapshotted");
        assert!(e.to_string().contains("raw block volume"), "{e}");
        let e = shim
            .rollback(&sandbox, &snap_id("block"), "block-op-1")
            .await
            .expect_err("nor rolled back");
        assert!(e.to_string().contains("raw block volume"), "{e}");
        let (code, _) = lab.exec(&id, &["true"]).await;
        assert_eq!(code, 0, "the pod runs on");
    }
    lab.remove_pod(&pod_id).await;
    let holders = holders(&dev.0);
    assert!(
        holders.is_empty(),
        "{handler}: {} still open in {holders:?}",
        dev.0.display()
    );
}

/// The processes holding `device` open.
fn holders(device: &Path) -> Vec<String> {
    processes(|proc| {
        std::fs::read_dir(proc.join("fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == device))
    })
}

/// The pids of the processes whose `/proc/<pid>` satisfies `pick`.
fn processes(pick: impl Fn(&Path) -> bool) -> Vec<String> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|p| pick(&p.path()))
        .map(|p| p.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn twig_gives_a_container_a_raw_block_volume_and_refuses_to_snapshot_it() {
    block_volume("twig");
}

#[test]
fn runc_gives_a_container_a_raw_block_volume() {
    block_volume("runc");
}
