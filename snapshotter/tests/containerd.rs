//! End to end with Debian's containerd 1.6: a multi-layer image built with
//! umoci is imported with `ctr images import --snapshotter twig`, unpacked by
//! containerd's differ through twig's loop mounts, run with runc, compared
//! file by file with umoci's own unpack, and garbage-collected on removal.

mod common;

use common::fstest::snapshot_tree;
use common::{sh, Daemon, LoopFs, Mounted, Snapshotter};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use twig_snapshotter::api::snapshots::{Kind, UsageRequest, ViewSnapshotRequest};

const IMAGE: &str = "docker.io/library/twigtest:v1";
const NS: &str = "twigtest";

/// containerd with its own root, state and socket, and `twig` as a proxy
/// snapshotter. Stopped by PID on drop.
struct Containerd {
    _daemon: Daemon,
    socket: PathBuf,
}

impl Containerd {
    fn start(dir: &Path, snapshotter_socket: &Path) -> Containerd {
        let socket = dir.join("containerd.sock");
        let config = dir.join("containerd.toml");
        fs::create_dir_all(dir).expect("containerd dir");
        fs::write(
            &config,
            format!(
                r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{socket}"

[proxy_plugins.twig]
  type = "snapshot"
  address = "{snap}"
"#,
                root = dir.join("root").display(),
                state = dir.join("state").display(),
                socket = socket.display(),
                snap = snapshotter_socket.display(),
            ),
        )
        .expect("writing containerd config");
        let mut daemon = Daemon::spawn(
            Command::new("containerd").arg("--config").arg(&config),
            dir.join("containerd.log"),
        );
        daemon
            .wait_for_socket(&socket, Duration::from_secs(60))
            .unwrap_or_else(|log| panic!("containerd did not start: {log}"));
        Containerd {
            _daemon: daemon,
            socket,
        }
    }

    fn ctr(&self, args: &[&str]) -> String {
        run_with_deadline(
            Command::new("ctr")
                .arg("--address")
                .arg(&self.socket)
                .args(["--namespace", NS])
                .args(args),
            Duration::from_secs(120),
        )
    }
}

/// Runs a command with a deadline; panics with its output on failure.
fn run_with_deadline(cmd: &mut Command, within: Duration) -> String {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let deadline = Instant::now() + within;
    loop {
        if child.try_wait().expect("waiting").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("reaping");
            panic!(
                "{cmd:?} did not finish within {within:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("reaping");
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}:\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A 64-bit ELF without a PT_INTERP program header (runs without a libc in
/// the image).
fn is_static_elf(elf: &[u8]) -> bool {
    let u16_at = |o: usize| {
        elf.get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
    };
    let u64_at = |o: usize| {
        elf.get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(|b| u64::from_le_bytes(b) as usize)
    };
    if elf.get(..5) != Some(b"\x7fELF\x02") {
        return false;
    }
    let (Some(phoff), Some(entsize), Some(num)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return false;
    };
    (0..num).all(|i| {
        let o = phoff + i * entsize;
        elf.get(o..o + 4) != Some(&3u32.to_le_bytes()[..])
    })
}

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).expect("chown");
}

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Builds a two-layer OCI image with umoci and returns (archive, expected
/// rootfs as umoci unpacks it).
fn build_image(dir: &Path) -> (PathBuf, PathBuf) {
    let layout = dir.join("layout");
    let tag = format!("{}:v1", layout.display());
    sh(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(&layout));
    sh(Command::new("umoci").args(["new", "--image", &tag]));

    // Layer 1: busybox, a symlink, owners, modes, a hard link, a setuid
    // file, and files and a directory that layer 2 deletes.
    let b1 = dir.join("bundle1");
    sh(Command::new("umoci")
        .args(["unpack", "--image", &tag])
        .arg(&b1));
    let r = b1.join("rootfs");
    for d in ["bin", "data", "data/olddir", "data/private", "tmp"] {
        fs::create_dir_all(r.join(d)).expect("mkdir");
    }
    fs::copy("/bin/busybox", r.join("bin/busybox")).expect("copying busybox-static");
    chmod(&r.join("bin/busybox"), 0o755);
    std::os::unix::fs::symlink("busybox", r.join("bin/sh")).expect("symlink");
    fs::write(r.join("data/keep"), "hello twig\n").unwrap();
    chmod(&r.join("data/keep"), 0o640);
    chown(&r.join("data/keep"), 1234, 5678);
    fs::hard_link(r.join("data/keep"), r.join("data/hard")).unwrap();
    std::os::unix::fs::symlink("keep", r.join("data/link")).unwrap();
    fs::write(r.join("data/gone"), "deleted in layer 2\n").unwrap();
    fs::write(r.join("data/olddir/inner"), "deleted with its dir\n").unwrap();
    fs::write(r.join("data/changed"), "v1\n").unwrap();
    chmod(&r.join("data/changed"), 0o644);
    fs::write(r.join("data/suid"), "#!/bin/sh\n").unwrap();
    chmod(&r.join("data/suid"), 0o4755);
    chmod(&r.join("data/private"), 0o700);
    chown(&r.join("data/private"), 42, 43);
    chmod(&r.join("tmp"), 0o1777);
    sh(Command::new("umoci")
        .args(["repack", "--image", &tag])
        .arg(&b1));

    // Layer 2: whiteouts for a file and a directory, a modified file, a new
    // file inside an existing directory.
    let b2 = dir.join("bundle2");
    sh(Command::new("umoci")
        .args(["unpack", "--image", &tag])
        .arg(&b2));
    let r = b2.join("rootfs");
    fs::remove_file(r.join("data/gone")).unwrap();
    fs::remove_dir_all(r.join("data/olddir")).unwrap();
    fs::write(r.join("data/changed"), "v2, longer\n").unwrap();
    fs::write(r.join("data/private/secret"), "s\n").unwrap();
    chown(&r.join("data/private/secret"), 42, 43);
    chmod(&r.join("data/private/secret"), 0o600);
    sh(Command::new("umoci")
        .args(["repack", "--image", &tag])
        .arg(&b2));
    sh(Command::new("umoci").args(["config", "--image", &tag, "--config.cmd", "/bin/sh"]));

    let expected = dir.join("expected");
    sh(Command::new("umoci")
        .args(["unpack", "--image", &tag])
        .arg(&expected));
    let archive = dir.join("image.tar");
    sh(Command::new("skopeo")
        .arg("copy")
        .arg(format!("oci:{tag}"))
        .arg(format!("oci-archive:{}:{IMAGE}", archive.display())));
    (archive, expected.join("rootfs"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_unpack_run_and_gc_with_containerd() {
    common::require(&[
        "containerd",
        "containerd-shim-runc-v2",
        "ctr",
        "runc",
        "umoci",
        "skopeo",
        "mkfs.ext4",
        "debugfs",
    ]);
    let busybox = fs::read("/bin/busybox").unwrap_or_default();
    assert!(
        is_static_elf(&busybox),
        "this test needs a static /bin/busybox (Debian's busybox-static, not busybox); \
         run scripts/install-deps.sh"
    );
    let xfs = LoopFs::xfs(400);
    let dir = xfs.dir.path().to_path_buf();
    let snap = Snapshotter::start(&xfs.path().join("store"), &dir.join("twig.sock"));
    let containerd = Containerd::start(&dir.join("containerd"), &snap.socket);
    let (archive, expected) = build_image(&dir);

    containerd.ctr(&[
        "images",
        "import",
        "--snapshotter",
        "twig",
        &archive.to_string_lossy(),
    ]);

    // Two committed layers, a parent chain, reported by twig itself.
    let mut client = snap.client().await;
    let infos = common::list_all(&mut client).await;
    assert_eq!(infos.len(), 2, "one snapshot per layer: {infos:#?}");
    assert!(infos.iter().all(|i| i.kind == Kind::Committed as i32));
    let bottom = infos
        .iter()
        .find(|i| i.parent.is_empty())
        .expect("bottom layer");
    let top = infos
        .iter()
        .find(|i| i.parent == bottom.name)
        .expect("top layer is a child of the bottom layer");

    // The top layer is a reflink of the bottom: it does not own busybox's
    // blocks, only what layer 2 changed.
    let top_usage = client
        .usage(UsageRequest {
            snapshotter: "twig".into(),
            key: top.name.clone(),
        })
        .await
        .expect("usage")
        .into_inner();
    let busybox = busybox.len() as i64;
    assert!(
        top_usage.size < busybox / 2,
        "top layer owns {} bytes; busybox alone is {busybox}",
        top_usage.size
    );

    // The unpacked rootfs equals umoci's unpack of the same image: files,
    // modes, owners, symlinks, hard links; whiteouts applied.
    let mounts = client
        .view(ViewSnapshotRequest {
            snapshotter: "twig".into(),
            key: "check-view".into(),
            parent: top.name.clone(),
            labels: Default::default(),
        })
        .await
        .expect("view")
        .into_inner()
        .mounts;
    {
        let work = dir.join("work");
        let view = Mounted::new(&mounts, &work, "view");
        let got = snapshot_tree(&view.path);
        let want = snapshot_tree(&expected);
        assert!(!got.contains_key("data/gone") && !got.contains_key("data/olddir"));
        assert_eq!(got, want, "unpacked rootfs differs from umoci's unpack");
    }
    client
        .remove(twig_snapshotter::api::snapshots::RemoveSnapshotRequest {
            snapshotter: "twig".into(),
            key: "check-view".into(),
        })
        .await
        .expect("remove view");

    // runc sees the same tree inside a container.
    let out = containerd.ctr(&[
        "run",
        "--rm",
        "--snapshotter",
        "twig",
        "--runtime",
        "io.containerd.runc.v2",
        IMAGE,
        "twig-check",
        "/bin/busybox",
        "sh",
        "-c",
        "cd /data && busybox stat -c '%n %a %u:%g %h %F' keep hard link changed suid private private/secret; \
         busybox readlink link; busybox cat keep changed; \
         [ \"$(busybox stat -c %i keep)\" = \"$(busybox stat -c %i hard)\" ] && echo same-inode; \
         for f in gone olddir; do [ -e $f ] || echo no-$f; done",
    ]);
    let want = "keep 640 1234:5678 2 regular file\n\
                hard 640 1234:5678 2 regular file\n\
                link 777 0:0 1 symbolic link\n\
                changed 644 0:0 1 regular file\n\
                suid 4755 0:0 1 regular file\n\
                private 700 42:43 2 directory\n\
                private/secret 600 42:43 1 regular file\n\
                keep\n\
                hello twig\n\
                v2, longer\n\
                same-inode\n\
                no-gone\n\
                no-olddir\n";
    assert_eq!(out, want, "container view of the rootfs");

    // What containerd relays to a runtime for a container on twig: one
    // ext4 loop mount whose source is the image file the twig shim attaches
    // as virtio-blk.
    let ls = containerd.ctr(&["snapshots", "--snapshotter", "twig", "ls"]);
    let top_name = ls
        .lines()
        .skip(1)
        .find_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() == 3).then(|| cols[0].to_string())
        })
        .unwrap_or_else(|| panic!("no layer with a parent in `ctr snapshots ls`:\n{ls}"));
    containerd.ctr(&[
        "snapshots",
        "--snapshotter",
        "twig",
        "prepare",
        "rootfs-for-vm",
        &top_name,
    ]);
    let cmd = containerd.ctr(&[
        "snapshots",
        "--snapshotter",
        "twig",
        "mounts",
        "/target",
        "rootfs-for-vm",
    ]);
    let words: Vec<&str> = cmd.split_whitespace().collect();
    assert_eq!(words.len(), 7, "{cmd}");
    assert_eq!(&words[..3], ["mount", "-t", "ext4"], "{cmd}");
    let options: Vec<String> = words[6].split(',').map(str::to_string).collect();
    let image = twig_snapshotter::block_image(words[2], words[3], &options)
        .unwrap_or_else(|| panic!("not a twig block image: {cmd}"));
    assert!(image.starts_with(snap.root.join("snapshots")), "{cmd}");
    let mut magic = [0u8; 2];
    std::os::unix::fs::FileExt::read_exact_at(&fs::File::open(&image).unwrap(), &mut magic, 1080)
        .unwrap();
    assert_eq!(magic, [0x53, 0xef], "{} is an ext4 image", image.display());
    containerd.ctr(&["snapshots", "--snapshotter", "twig", "rm", "rootfs-for-vm"]);

    // Removing the image lets containerd's label-driven GC remove every
    // snapshot through the proxy: the store ends up empty.
    containerd.ctr(&["images", "rm", "--sync", IMAGE]);
    let store = snap.root.join("snapshots");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = fs::read_dir(&store).expect("store dir").count();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} snapshots left in {} after image removal and GC",
            store.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(containerd);
    drop(snap);
}

#[test]
fn static_elf_check_tells_static_from_dynamic() {
    let ls = fs::read("/bin/ls").expect("/bin/ls");
    assert!(!is_static_elf(&ls), "/bin/ls is dynamically linked");
    assert!(!is_static_elf(b"#!/bin/sh\n"));
    let busybox = fs::read("/bin/busybox").expect("/bin/busybox from busybox-static");
    assert!(is_static_elf(&busybox), "Debian's busybox-static is static");
}
