//! The shim's own time per pod on this machine's CPUs: containerd's Task
//! calls for a pod (Create + Start of its sandbox container, then of one
//! app container) over ttrpc to the real `TaskService`, against a real
//! `twig-agent` on the host (`HostSandbox`, the shim tests' seam) instead
//! of one inside a VM. The shim's `timing` lines split each call into the
//! time waiting on the sandbox (the VM's launch, the agent) and the rest,
//! the shim's own; this benchmark collects them, so the figure is the one
//! `twig-bench cri` reports from the lab, measured here without the lab's
//! instruction-by-instruction emulation. One `TaskService` and ttrpc
//! server per pod, as one shim process serves one pod; one agent for all.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api;
use containerd_shim_protos::shim_async::TaskClient;
use containerd_shim_protos::ttrpc::context::Context as TtrpcContext;
use containerd_shim_protos::ttrpc::r#async::{transport::Listener, Client, Server};
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context as LayerContext, SubscriberExt};
use tracing_subscriber::Layer;
use twig_shim::sandbox::{Fixed, HostSandbox};
use twig_shim::server::task_services;
use twig_shim::service::TaskService;
use twig_shim::spec::{CONTAINER_TYPE_ANNOTATION, SANDBOX_ID_ANNOTATION};

use crate::stats::{Context, Error, Report};
use crate::vmm::workspace_binary;

/// Every wait of the benchmark.
const T: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct Args {
    /// Timed pods.
    #[arg(long, default_value_t = 50)]
    runs: usize,
    /// Untimed pods first (page cache, allocator, the agent's first mounts).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Directory under which bundles, rootfs images and sockets are made.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
}

/// One `timing` line of the shim.
#[derive(Debug, Default, Clone)]
struct Timing {
    call: String,
    id: String,
    own_us: u64,
    vm_us: u64,
}

impl Visit for Timing {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "call" => self.call = value.to_string(),
            "id" => self.id = value.to_string(),
            _ => {}
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "own_us" => self.own_us = value,
            "vm_us" => self.vm_us = value,
            _ => {}
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

/// Collects the shim's `timing` events.
#[derive(Clone, Default)]
struct Timings(Arc<Mutex<Vec<Timing>>>);

impl<S: tracing::Subscriber> Layer<S> for Timings {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: LayerContext<'_, S>) {
        let mut t = Timing::default();
        event.record(&mut t);
        if !t.call.is_empty() && event.metadata().target().starts_with("twig_shim") {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).push(t);
        }
    }
}

impl Timings {
    fn take(&self) -> Vec<Timing> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// `twig-agent --listen` on the host, in its own pid and mount namespaces
/// (it mounts the containers' rootfs images); killed on drop.
struct Agent {
    child: Child,
    socket: PathBuf,
}

impl Agent {
    fn start(dir: &Path) -> Result<Agent, Error> {
        let bin = workspace_binary("twig-agent")?;
        let socket = dir.join("agent.sock");
        let script = format!(
            "exec {} --listen unix://{} --state-dir {}",
            bin.display(),
            socket.display(),
            dir.join("agent-state").display()
        );
        let log = std::fs::File::create(dir.join("agent.log")).context(|| "agent.log".into())?;
        let child = Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc"])
            .args(["sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context(|| "starting twig-agent under unshare".into())?;
        Ok(Agent { child, socket })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ctx() -> TtrpcContext {
    TtrpcContext {
        timeout_nano: T.as_nanos() as i64,
        ..Default::default()
    }
}

fn mkfifo(path: &Path) -> Result<(), Error> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .context(|| format!("mkfifo {}", path.display()))?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } == 0 {
        Ok(())
    } else {
        Err(format!(
            "mkfifo {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        )
        .into())
    }
}

/// A bundle (`config.json` + a busybox rootfs image) for one container.
fn bundle(dir: &Path, name: &str, args: &[&str], annotations: Value) -> Result<PathBuf, Error> {
    let b = dir.join(name);
    std::fs::create_dir_all(&b).context(|| format!("creating {}", b.display()))?;
    let spec = twig_agent::testkit::spec(args, json!({ "annotations": annotations }));
    std::fs::write(b.join("config.json"), spec).context(|| "writing config.json".into())?;
    twig_agent::testkit::busybox_rootfs(&b.join("rootfs.img"), 16, &[])
        .context(|| format!("building the rootfs image of {name}"))?;
    Ok(b)
}

fn create_request(id: &str, bundle: &Path, stdout: &str, stderr: &str) -> api::CreateTaskRequest {
    api::CreateTaskRequest {
        id: id.into(),
        bundle: bundle.display().to_string(),
        rootfs: vec![api::Mount {
            type_: "ext4".into(),
            source: bundle.join("rootfs.img").display().to_string(),
            options: vec!["rw".into(), "loop".into()],
            ..Default::default()
        }],
        stdout: stdout.into(),
        stderr: stderr.into(),
        ..Default::default()
    }
}

/// What one pod's Task calls cost.
struct Pod {
    /// The four calls, end to end, as containerd waits on them (their
    /// difference to `waiting` is the shim's own time plus ttrpc's).
    calls: Duration,
    /// Until the app container's first output reached its FIFO.
    first_output: Duration,
    /// The shim's own time in the four calls.
    own: Duration,
    /// The time of the four calls spent waiting on the sandbox (the agent).
    waiting: Duration,
    /// Own time per call (`create sandbox`, …).
    per_call: Vec<(String, Duration)>,
}

async fn one_pod(dir: &Path, agent: &Path, index: usize, timings: &Timings) -> Result<Pod, Error> {
    let pod = format!("pod{index}");
    let (sid, cid) = (format!("{pod}-sandbox"), format!("{pod}-app"));
    let sandbox_bundle = bundle(
        dir,
        &sid,
        &["sleep", "3600"],
        json!({ CONTAINER_TYPE_ANNOTATION: "sandbox", SANDBOX_ID_ANNOTATION: sid }),
    )?;
    let app_bundle = bundle(
        dir,
        &cid,
        &["echo", "first output"],
        json!({ CONTAINER_TYPE_ANNOTATION: "container", SANDBOX_ID_ANNOTATION: sid }),
    )?;
    let (out, err) = (
        dir.join(format!("{cid}.out")),
        dir.join(format!("{cid}.err")),
    );
    mkfifo(&out)?;
    mkfifo(&err)?;
    let mut stdout = pipe::OpenOptions::new()
        .open_receiver(&out)
        .context(|| "opening the stdout FIFO".into())?;
    let mut stderr = pipe::OpenOptions::new()
        .open_receiver(&err)
        .context(|| "opening the stderr FIFO".into())?;
    tokio::spawn(async move {
        let mut sink = Vec::new();
        let _ = stderr.read_to_end(&mut sink).await;
    });

    // One shim: its service, its ttrpc server, containerd's client.
    let socket = agent.to_path_buf();
    let sandbox = tokio::task::spawn_blocking(move || HostSandbox::connect(&socket, T))
        .await
        .context(|| "connecting to the agent".into())?
        .context(|| "connecting to the agent".into())?;
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move { while events.recv().await.is_some() {} });
    let service = TaskService::new(
        Arc::new(Fixed(Arc::new(sandbox))),
        tx,
        Arc::new(ExitSignal::default()),
        T,
    );
    let sock = dir.join(format!("{pod}.sock"));
    let listener = std::os::unix::net::UnixListener::bind(&sock)
        .context(|| format!("binding {}", sock.display()))?;
    let mut server = Server::new()
        .add_listener(Listener::try_from(listener).context(|| "ttrpc listener".into())?)
        .register_service(task_services(service));
    server.start().await.context(|| "starting ttrpc".into())?;
    let client = TaskClient::new(
        Client::connect(&format!("unix://{}", sock.display()))
            .await
            .context(|| "connecting to the shim".into())?,
    );
    timings.take();

    let start = Instant::now();
    let c = &client;
    c.create(ctx(), &create_request(&sid, &sandbox_bundle, "", ""))
        .await
        .context(|| "Create of the sandbox container".into())?;
    c.start(ctx(), &start_request(&sid))
        .await
        .context(|| "Start of the sandbox container".into())?;
    c.create(
        ctx(),
        &create_request(
            &cid,
            &app_bundle,
            &out.display().to_string(),
            &err.display().to_string(),
        ),
    )
    .await
    .context(|| "Create of the app container".into())?;
    c.start(ctx(), &start_request(&cid))
        .await
        .context(|| "Start of the app container".into())?;
    let calls = start.elapsed();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(T, stdout.read(&mut buf))
        .await
        .context(|| "waiting for the app container's output".into())?
        .context(|| "reading the app container's output".into())?;
    let first_output = start.elapsed();
    if n == 0 {
        return Err("the app container ended without output".into());
    }

    let mut per_call = Vec::new();
    let (mut own, mut waiting) = (Duration::ZERO, Duration::ZERO);
    for t in timings.take() {
        waiting += Duration::from_micros(t.vm_us);
        let role = if t.id == sid { "sandbox" } else { "app" };
        let d = Duration::from_micros(t.own_us);
        own += d;
        per_call.push((format!("{}_{role}", t.call), d));
    }
    if per_call.len() != 4 {
        return Err(format!("expected 4 timing lines from the shim, got {per_call:?}").into());
    }

    // Teardown, untimed: the app exits by itself, the sandbox is killed.
    wait_exit(c, &cid).await?;
    c.kill(
        ctx(),
        &api::KillRequest {
            id: sid.clone(),
            signal: 9,
            all: true,
            ..Default::default()
        },
    )
    .await
    .context(|| "killing the sandbox container".into())?;
    wait_exit(c, &sid).await?;
    for id in [&cid, &sid] {
        c.delete(
            ctx(),
            &api::DeleteRequest {
                id: id.clone(),
                ..Default::default()
            },
        )
        .await
        .context(|| format!("deleting {id}"))?;
    }
    server
        .shutdown()
        .await
        .context(|| "stopping ttrpc".into())?;
    for b in [&sandbox_bundle, &app_bundle] {
        std::fs::remove_dir_all(b).context(|| format!("removing {}", b.display()))?;
    }
    Ok(Pod {
        calls,
        first_output,
        own,
        waiting,
        per_call,
    })
}

fn start_request(id: &str) -> api::StartRequest {
    api::StartRequest {
        id: id.into(),
        ..Default::default()
    }
}

async fn wait_exit(c: &TaskClient, id: &str) -> Result<(), Error> {
    c.wait(
        ctx(),
        &api::WaitRequest {
            id: id.into(),
            ..Default::default()
        },
    )
    .await
    .context(|| format!("waiting for {id} to exit"))?;
    Ok(())
}

pub fn run(args: &Args) -> Result<Value, Error> {
    if args.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    let timings = Timings::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(timings.clone()))
        .context(|| "installing the timing collector".into())?;
    let tmp = tempfile::Builder::new()
        .prefix("twig-bench-shim-")
        .tempdir_in(&args.dir)
        .context(|| format!("creating a temporary directory in {}", args.dir.display()))?;
    let dir = std::path::absolute(tmp.path()).context(|| "resolving the temp dir".into())?;
    let agent = Agent::start(&dir)?;
    let deadline = Instant::now() + T;
    while !agent.socket.exists() {
        if Instant::now() > deadline {
            return Err(format!(
                "twig-agent did not listen on {} within {T:?}; see {}",
                agent.socket.display(),
                dir.join("agent.log").display()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context(|| "starting tokio".into())?;
    let pods = rt.block_on(async {
        let mut pods = Vec::new();
        for i in 0..args.warmup + args.runs {
            let pod = one_pod(&dir, &agent.socket, i, &timings).await?;
            if i >= args.warmup {
                pods.push(pod);
            }
        }
        Ok::<_, Error>(pods)
    })?;
    drop(agent);

    eprintln!(
        "the shim's Task calls for a pod (sandbox + one container), {} pods after {} untimed, \
         against twig-agent on the host:",
        args.runs, args.warmup
    );
    let mut report = Report::default();
    let samples = |f: &dyn Fn(&Pod) -> Duration| pods.iter().map(f).collect::<Vec<_>>();
    report.timing("shim_own_ms", &samples(&|p| p.own));
    report.timing(
        "shim_side_ms",
        &samples(&|p| p.calls.saturating_sub(p.waiting)),
    );
    report.timing("waiting_on_agent_ms", &samples(&|p| p.waiting));
    report.timing("task_calls_ms", &samples(&|p| p.calls));
    report.timing("first_output_ms", &samples(&|p| p.first_output));
    let mut by_call: HashMap<String, Vec<Duration>> = HashMap::new();
    for p in &pods {
        for (call, d) in &p.per_call {
            by_call.entry(call.clone()).or_default().push(*d);
        }
    }
    let mut calls: Vec<_> = by_call.into_iter().collect();
    calls.sort_by(|a, b| a.0.cmp(&b.0));
    for (call, d) in calls {
        report.timing(&format!("own_{call}_ms"), &d);
    }
    report.value(
        "cpus",
        json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
    );
    Ok(report.into_value())
}
