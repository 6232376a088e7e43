//! Issue 25, item 5: every image charts/twig names is built by
//! `scripts/build-images.sh` (umoci and skopeo, no container builder),
//! runs, and is what the chart's objects pull.
//!
//! - The layouts: each image's config (entrypoint, user, version label), its
//!   rootfs (the binary and the libraries it needs, nothing else for the
//!   controller and twig-api), and each binary run from the unpacked rootfs
//!   (chroot, as the image's user) with the arguments the chart gives it;
//!   the installer's command from the chart installs a node bundle into a
//!   root with the image's own busybox and bash.
//! - The registry: the images pushed by the script (`--push`) into the CRI
//!   harness's registry (Debian's docker-registry on loopback, started and
//!   stopped by PID with the harness), the same digests read back with
//!   `skopeo inspect`; the chart's objects rendered with `image.registry`
//!   pointing there (helm template, read by kubectl offline) name exactly
//!   those images; containerd's CRI plugin pulls each as kubelet would and
//!   runs the controller's, twig-api's and the installer's containers with
//!   runc, with the chart's commands and arguments.
//!
//! No kube-apiserver runs here: "installing the chart's objects" is their
//! images pulled and their containers run by a real containerd. Runs on the
//! host, not in the lab (the lab carries neither umoci, skopeo nor the
//! registry; nothing here needs KVM). Needs root (chroot, containerd, CNI
//! bridge), umoci, skopeo, docker-registry, containerd and runc
//! (scripts/install-deps.sh), and helm and kubectl (scripts/kube-tools.sh);
//! it fails, never skips, without them. The controller and twig-api are
//! built with the dev profile and the installer gets a stand-in bundle
//! (the installer copies its files as opaque bytes), to keep it quick.
#![cfg(not(feature = "lab"))]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use twig_controller_testkit::kube_tools::{helm, kubectl};
use twig_cri::api::{self, ContainerState};
use twig_cri::{container_config, logs, Node, NodeOptions};
use twig_e2e::{run, Output};

const VERSION: &str = env!("CARGO_PKG_VERSION");
const IMAGES: [&str; 3] = ["twig-controller", "twig-api", "twig-node-installer"];
/// The bundle files the installer puts on a node, with the stand-ins' content.
const BUNDLE: [(&str, &str); 6] = [
    (
        "bin/containerd-shim-twig-v2",
        "usr/local/bin/containerd-shim-twig-v2",
    ),
    ("bin/twig-vmm", "usr/local/bin/twig-vmm"),
    ("bin/twig-node", "usr/local/bin/twig-node"),
    ("bin/twig-snapshotter", "usr/local/bin/twig-snapshotter"),
    ("share/vmlinux", "usr/share/twig/vmlinux"),
    (
        "share/agent-initrd.cpio.gz",
        "usr/share/twig/agent-initrd.cpio.gz",
    ),
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ has a parent")
        .to_path_buf()
}

fn require_root() {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root (chroot into the images' rootfs, containerd, a CNI bridge): run it as root"
    );
}

fn ok(out: Output, what: &str) -> String {
    assert!(out.status.success(), "{what}: {out}");
    out.stdout
}

/// A node bundle as `install-node.sh --bundle` lays it out, with small
/// stand-ins for the binaries and guest files, and the real install-node.sh.
fn stand_in_bundle(dir: &Path) -> PathBuf {
    let b = dir.join("bundle");
    for (file, _) in BUNDLE {
        let path = b.join(file);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, format!("stand-in {file}\n")).expect("write");
    }
    std::fs::copy(
        workspace().join("scripts/install-node.sh"),
        b.join("install-node.sh"),
    )
    .expect("copy install-node.sh");
    b
}

/// Runs scripts/build-images.sh (dev profile, the stand-in bundle) into
/// `dir/images` with `extra`; the references it printed.
fn build_images(dir: &Path, extra: &[&str]) -> (PathBuf, Vec<String>) {
    let out = dir.join("images");
    let bundle = stand_in_bundle(dir);
    let printed = ok(
        run(
            twig_store::testkit::clear_cargo_test_env(&mut Command::new(
                workspace().join("scripts/build-images.sh"),
            ))
            .args(["--profile", "dev", "--bundle"])
            .arg(&bundle)
            .arg("--out")
            .arg(&out)
            .args(extra)
            .env("CARGO_INCREMENTAL", "0"),
            Duration::from_secs(1800),
        )
        .expect("run build-images.sh"),
        "scripts/build-images.sh",
    );
    (out, printed.lines().map(str::to_string).collect())
}

fn tool(program: &str, args: &[&str]) -> String {
    ok(
        run(Command::new(program).args(args), Duration::from_secs(300))
            .unwrap_or_else(|e| panic!("{program}: {e} (scripts/install-deps.sh installs it)")),
        program,
    )
}

/// The chart's objects with `values` over its defaults, as kubectl reads
/// them (offline: `kubectl label --local` prints each object as JSON).
fn chart_objects(dir: &Path, values: &Value) -> Vec<Value> {
    let values_file = dir.join("values.json");
    std::fs::write(&values_file, values.to_string()).expect("values");
    let rendered = ok(
        run(
            Command::new(helm())
                .args(["template", "twig"])
                .arg(workspace().join("charts/twig"))
                .args(["--namespace", "twig-system", "--values"])
                .arg(&values_file),
            Duration::from_secs(60),
        )
        .expect("helm"),
        "helm template",
    );
    let manifests = dir.join("rendered.yaml");
    std::fs::write(&manifests, rendered).expect("write manifests");
    let json = ok(
        run(
            Command::new(kubectl())
                .args(["label", "--local", "-o", "json", "-f"])
                .arg(&manifests)
                .arg("test.twig.dev/rendered=yes"),
            Duration::from_secs(60),
        )
        .expect("kubectl"),
        "kubectl label --local",
    );
    let objects: Vec<Value> = serde_json::Deserializer::from_str(&json)
        .into_iter::<Value>()
        .map(|o| o.expect("kubectl's JSON"))
        .collect();
    assert!(objects.len() > 10, "the chart's objects: {json}");
    objects
}

/// Every chart part on, the installer not starting host services, images
/// from `registry`.
fn chart_values(registry: &str) -> Value {
    json!({
        "image": {"registry": registry},
        "api": {"enabled": true, "domain": "sandbox.example"},
        "nodeSetup": {"start": false, "containerdVersion": "1.7"},
    })
}

/// The (pod-template owner, container) pairs of `objects`, init containers included.
fn containers(objects: &[Value]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for o in objects {
        let pod = &o["spec"]["template"]["spec"];
        for list in ["initContainers", "containers"] {
            for c in pod[list].as_array().into_iter().flatten() {
                let owner = format!(
                    "{}/{}",
                    o["kind"].as_str().unwrap_or_default(),
                    o["metadata"]["name"].as_str().unwrap_or_default()
                );
                out.push((owner, c.clone()));
            }
        }
    }
    out
}

fn container<'a>(all: &'a [(String, Value)], owner: &str, name: &str) -> &'a Value {
    all.iter()
        .find(|(o, c)| o == owner && c["name"] == name)
        .map(|(_, c)| c)
        .unwrap_or_else(|| panic!("no container {name} in {owner}"))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|s| s.as_str().expect("a string").to_string())
        .collect()
}

/// Checks the installer's work under `root`: the bundle's files where the
/// node reads them, and the containerd drop-in.
fn assert_installed(root: &Path) {
    for (file, dest) in BUNDLE {
        let got = std::fs::read_to_string(root.join(dest))
            .unwrap_or_else(|e| panic!("{dest} not installed: {e}"));
        assert_eq!(got, format!("stand-in {file}\n"), "{dest}");
    }
    let dropin = std::fs::read_to_string(root.join("etc/containerd/conf.d/twig.toml"))
        .expect("the containerd drop-in");
    assert!(
        dropin.contains("runtime_type = \"io.containerd.twig.v2\""),
        "{dropin}"
    );
}

#[test]
fn build_images_sh_builds_images_that_run_the_charts_commands() {
    require_root();
    let dir = tempfile::tempdir().expect("tempdir");
    let (out, refs) = build_images(dir.path(), &["--archive"]);
    let expected: Vec<String> = IMAGES
        .iter()
        .map(|n| format!("ghcr.io/twig-dev/{n}:{VERSION}"))
        .collect();
    assert_eq!(refs, expected, "the script prints what it built");
    let objects = chart_objects(dir.path(), &chart_values("ghcr.io/twig-dev"));
    let all = containers(&objects);
    let rendered: BTreeSet<String> = all
        .iter()
        .map(|(_, c)| c["image"].as_str().expect("image").to_string())
        .collect();
    assert_eq!(rendered, refs.iter().cloned().collect::<BTreeSet<_>>());

    for name in IMAGES {
        let layout = format!("oci:{}:{VERSION}", out.join(name).display());
        let config: Value =
            serde_json::from_str(&tool("skopeo", &["inspect", "--config", &layout]))
                .expect("image config");
        let c = &config["config"];
        assert_eq!(
            c["Labels"]["org.opencontainers.image.version"],
            json!(VERSION),
            "{name}"
        );
        let archive = out.join(format!("{name}-{VERSION}.tar"));
        let from_archive: Value = serde_json::from_str(&tool(
            "skopeo",
            &["inspect", &format!("oci-archive:{}", archive.display())],
        ))
        .expect("archive manifest");
        let from_layout: Value =
            serde_json::from_str(&tool("skopeo", &["inspect", &layout])).expect("manifest");
        assert_eq!(
            from_archive["Digest"], from_layout["Digest"],
            "{name}: the archive holds the layout's image"
        );

        let bundle = dir.path().join(format!("unpacked-{name}"));
        tool(
            "umoci",
            &[
                "unpack",
                "--image",
                &format!("{}:{VERSION}", out.join(name).display()),
                &bundle.display().to_string(),
            ],
        );
        let rootfs = bundle.join("rootfs");
        if name == "twig-node-installer" {
            assert_eq!(c["User"], json!("0:0"), "the installer runs as root");
            // The chart's install command, into the root the pod mounts at
            // /host, with the image's own busybox and bash.
            let install = container(&all, "DaemonSet/twig-node-setup", "install");
            let command = strings(&install["command"]);
            assert_eq!(
                command[..5],
                [
                    "/opt/twig/install-node.sh",
                    "--from",
                    "/opt/twig",
                    "--root",
                    "/host"
                ]
            );
            std::fs::create_dir_all(rootfs.join("host")).expect("mkdir host");
            ok(
                run(
                    Command::new("chroot").arg(&rootfs).args(&command),
                    Duration::from_secs(60),
                )
                .expect("chroot"),
                "the installer's command in its image",
            );
            assert_installed(&rootfs.join("host"));
            // The pause container's shell and the --start path's nsenter.
            let pause = container(&all, "DaemonSet/twig-node-setup", "pause");
            assert_eq!(strings(&pause["command"])[0], "sh");
            ok(
                run(
                    Command::new("chroot").arg(&rootfs).args([
                        "sh",
                        "-c",
                        "command -v nsenter && command -v sh",
                    ]),
                    Duration::from_secs(30),
                )
                .expect("chroot"),
                "sh and nsenter in the installer image",
            );
            continue;
        }
        let entrypoint = format!("/usr/local/bin/{name}");
        assert_eq!(c["Entrypoint"], json!([entrypoint]), "{name}");
        assert_eq!(c["User"], json!("65532:65532"), "{name} runs as non-root");
        // Only the binary and the libraries it needs: no shell.
        assert!(!rootfs.join("bin/sh").exists(), "{name} has a shell");
        let mut files = Vec::new();
        let mut stack = vec![rootfs.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).expect("read_dir") {
                let p = e.expect("entry").path();
                if p.is_dir() && !p.is_symlink() {
                    stack.push(p);
                } else {
                    files.push(
                        p.strip_prefix(&rootfs)
                            .expect("under")
                            .display()
                            .to_string(),
                    );
                }
            }
        }
        files.sort();
        assert!(
            files.iter().all(|f| f.starts_with("usr/local/bin/")
                || f.starts_with("lib/")
                || f.starts_with("lib64/")
                || f == "etc/passwd"
                || f == "etc/group"),
            "{name}: {files:?}"
        );
        // The binary runs from the rootfs, as the image's user, with the
        // arguments the chart gives it.
        let (owner, cname) = match name {
            "twig-controller" => ("DaemonSet/twig-controller", "controller"),
            _ => ("Deployment/twig-api", "api"),
        };
        let args = strings(&container(&all, owner, cname)["args"]);
        assert!(!args.is_empty(), "{owner} gives {name} arguments");
        let help = ok(
            run(
                Command::new("chroot")
                    .arg("--userspec=65532:65532")
                    .arg(&rootfs)
                    .arg(&entrypoint)
                    .args(&args)
                    .arg("--help"),
                Duration::from_secs(30),
            )
            .expect("chroot"),
            &format!("{name} {args:?} --help in its image"),
        );
        assert!(help.contains("Usage:"), "{name}: {help}");
        let version = ok(
            run(
                Command::new("chroot")
                    .arg(&rootfs)
                    .arg(&entrypoint)
                    .arg("--version"),
                Duration::from_secs(30),
            )
            .expect("chroot"),
            &format!("{name} --version"),
        );
        assert!(version.contains(VERSION), "{name}: {version}");
    }
}

/// Waits until container `id` exits; its exit code.
async fn exit_code(cri: &twig_cri::CriClient, id: &str, within: Duration) -> i32 {
    let deadline = Instant::now() + within;
    loop {
        let status = cri.container_status(id).await.expect("container status");
        if status.state() == ContainerState::ContainerExited {
            return status.exit_code;
        }
        assert!(
            Instant::now() < deadline,
            "container {id} still {:?} after {within:?}",
            status.state()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_objects_pull_their_images_from_the_registry_and_run() {
    require_root();
    let node = Node::start(&NodeOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let registry = format!("{}/twig", node.registry().host());
    let dir = tempfile::tempdir().expect("tempdir");
    let (out, pushed) = build_images(
        dir.path(),
        &["--registry", &registry, "--push", "--insecure"],
    );
    let expected: Vec<String> = IMAGES
        .iter()
        .map(|n| format!("{registry}/{n}:{VERSION}"))
        .collect();
    assert_eq!(pushed, expected);
    // The registry serves what was built, digest for digest.
    for (name, reference) in IMAGES.iter().zip(&pushed) {
        let remote: Value = serde_json::from_str(&tool(
            "skopeo",
            &[
                "inspect",
                "--tls-verify=false",
                &format!("docker://{reference}"),
            ],
        ))
        .expect("remote manifest");
        let local: Value = serde_json::from_str(&tool(
            "skopeo",
            &[
                "inspect",
                &format!("oci:{}:{VERSION}", out.join(name).display()),
            ],
        ))
        .expect("local manifest");
        assert_eq!(remote["Digest"], local["Digest"], "{reference}");
    }

    // The chart's objects name exactly those images; kubelet's path
    // (containerd's CRI plugin) pulls each from the registry.
    let objects = chart_objects(dir.path(), &chart_values(&registry));
    let all = containers(&objects);
    let named: BTreeSet<String> = all
        .iter()
        .map(|(_, c)| c["image"].as_str().expect("image").to_string())
        .collect();
    assert_eq!(named, pushed.iter().cloned().collect::<BTreeSet<_>>());
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
    for image in &named {
        assert!(!cri.image_present(image).await.expect("image status"));
        let id = cri
            .pull_image(image)
            .await
            .unwrap_or_else(|e| panic!("pulling {image}: {e}"));
        assert!(id.starts_with("sha256:"), "{id}");
    }

    // Their containers run under runc as the chart runs them: the
    // controller and twig-api with the chart's arguments (and --help: no
    // API server here), the installer's command into a root at /host.
    let pod = node.pod_config("chart").unwrap_or_else(|e| panic!("{e}"));
    let pod_id = cri
        .run_pod_sandbox(&pod, "runc")
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", node.containerd().log_text()));
    let host_root = dir.path().join("host-root");
    std::fs::create_dir_all(&host_root).expect("mkdir");
    let runs = [
        ("DaemonSet/twig-controller", "controller"),
        ("Deployment/twig-api", "api"),
        ("DaemonSet/twig-node-setup", "install"),
    ];
    for (owner, name) in runs {
        let c = container(&all, owner, name);
        let image = c["image"].as_str().expect("image");
        let command = strings(&c["command"]);
        let command: Vec<&str> = command.iter().map(String::as_str).collect();
        let log = format!("{name}.log");
        let mut config = container_config(name, image, &command, &log);
        config.args = strings(&c["args"]);
        if name != "install" {
            config.args.push("--help".into());
        } else {
            config.mounts = vec![api::Mount {
                container_path: "/host".into(),
                host_path: host_root.display().to_string(),
                ..Default::default()
            }];
        }
        let id = cri
            .create_container(&pod_id, &config, &pod)
            .await
            .unwrap_or_else(|e| panic!("creating {name}: {e}"));
        cri.start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let code = exit_code(&cri, &id, Duration::from_secs(60)).await;
        let lines = logs::read(&Node::container_log(&pod, &log));
        let text: Vec<&str> = lines.iter().map(|l| l.text.as_str()).collect();
        assert_eq!(code, 0, "{owner} {name} in {image}: {text:?}");
        if name != "install" {
            assert!(
                text.iter().any(|l| l.starts_with("Usage:")),
                "{name}: {text:?}"
            );
        }
    }
    assert_installed(&host_root);
    let _ = cri.stop_pod_sandbox(&pod_id).await;
    let _ = cri.remove_pod_sandbox(&pod_id).await;
}
