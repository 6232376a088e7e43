//! One pod's worker: kubelet's pod worker and `SyncPod` for one pod. It
//! checks what it can honour, lays out the volumes, runs the sandbox, then
//! passes over the pod every sync period (and whenever a probe answers, a
//! ConfigMap or Secret changes or the pod is updated): reads its
//! containers' states from CRI, runs the probes that are due, does what
//! [`lifecycle::plan`] says, rewrites changed volumes and writes the pod's
//! status when it changed. When the pod is gone it stops everything.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerStateTerminated, ContainerStatus, Pod, PodIP, PodStatus, Secret,
    ServiceAccount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::Api;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinSet;
use twig_cri::api;

use super::atomic::AtomicWriter;
use super::lifecycle::{self, Action, Backoff, PodShape, RestartPolicy, RunState, Tracked};
use super::probes::{self, Handler, Kind};
use super::status::{self, Conditions};
use super::volumes::{self, Lookup, PodVolumes};
use super::{dns, random_u32, Shared, CONTAINER_ID_PREFIX};

/// How long the stores may take to list before the first volume write.
const STORES_READY: Duration = Duration::from_secs(10);
/// kubelet's shortest stop after a preStop hook used up the grace period.
const MIN_STOP_GRACE: Duration = Duration::from_secs(2);

/// The namespace's ConfigMaps and Secrets from the kubelet's stores.
struct StoreLookup<'a> {
    shared: &'a Shared,
    namespace: &'a str,
}

impl Lookup for StoreLookup<'_> {
    fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>> {
        let found = self
            .shared
            .config_maps
            .get(&ObjectRef::new(name).within(self.namespace));
        if found.is_none() && name == volumes::ROOT_CA_CONFIG_MAP {
            return Some(Arc::new(ConfigMap {
                data: Some([("ca.crt".to_string(), self.shared.config.root_ca.clone())].into()),
                ..Default::default()
            }));
        }
        found
    }

    fn secret(&self, name: &str) -> Option<Arc<Secret>> {
        self.shared
            .secrets
            .get(&ObjectRef::new(name).within(self.namespace))
    }
}

/// One instance of a container, and what is known of it.
struct Instance {
    id: String,
    attempt: u32,
    cri: Option<api::ContainerStatus>,
    tracked: Tracked,
    message_file: PathBuf,
    log: PathBuf,
    terminated: Option<ContainerStateTerminated>,
    /// The instance before, kept until the next restart (kubelet keeps one
    /// dead container per name).
    previous: Option<(String, Option<ContainerStateTerminated>)>,
    ready: bool,
}

/// A pod's worker.
struct Worker {
    shared: Arc<Shared>,
    pod: Pod,
    name: String,
    namespace: String,
    uid: String,
    dir: PathBuf,
    logs: PathBuf,
    containers: Vec<(Container, bool)>,
    shape: PodShape,
    grace: Duration,
    sandbox: Option<String>,
    sandbox_config: api::PodSandboxConfig,
    sandbox_stopped: bool,
    ip: Option<IpAddr>,
    volumes: PodVolumes,
    volumes_ready: bool,
    volume_error: Option<String>,
    token: String,
    token_at: Instant,
    instances: HashMap<String, Instance>,
    backoff: Backoff,
    waiting: HashMap<String, (String, String)>,
    retry_at: HashMap<String, Instant>,
    probes: HashMap<(String, Kind), (String, probes::Worker)>,
    probing: HashSet<(String, Kind)>,
    in_flight: JoinSet<(String, Kind, String, Result<(), String>)>,
    initialized: bool,
    init_failed: bool,
    failed: Option<String>,
    conditions: Conditions,
    start_time: Time,
    written: Option<Value>,
}

/// Runs the pod `pods` carries until its sender is dropped, then stops it.
pub(super) async fn run(shared: Arc<Shared>, mut pods: watch::Receiver<Arc<Pod>>) {
    let pod = (**pods.borrow_and_update()).clone();
    let mut w = Worker::new(shared, pod).await;
    if let Err(e) = w.check() {
        w.failed = Some(e);
    }
    let mut objects = w.shared.objects.clone();
    loop {
        if w.failed.is_none() {
            w.pass().await;
        }
        w.write_status().await;
        let wake = tokio::time::Instant::from_std(w.next_wake());
        tokio::select! {
            changed = pods.changed() => {
                if changed.is_err() {
                    break;
                }
                let latest = pods.borrow_and_update().clone();
                w.pod.metadata = latest.metadata.clone();
                w.volumes_ready = false;
            }
            _ = objects.changed() => w.volumes_ready = false,
            Some(done) = w.in_flight.join_next() => {
                if let Ok((name, kind, id, result)) = done {
                    w.probed(&name, kind, &id, result);
                }
            }
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
    w.stop().await;
}

impl Worker {
    async fn new(shared: Arc<Shared>, mut pod: Pod) -> Worker {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let account = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| "default".into());
        let accounts: Api<ServiceAccount> = Api::namespaced(shared.client.clone(), &namespace);
        let automount = accounts
            .get_opt(&account)
            .await
            .ok()
            .flatten()
            .and_then(|a| a.automount_service_account_token);
        if shared.config.service_account_token {
            volumes::inject_service_account_volume(&mut pod, automount);
        }
        let spec = pod.spec.clone().unwrap_or_default();
        let init = spec.init_containers.clone().unwrap_or_default();
        let sidecar = |c: &Container| c.restart_policy.as_deref() == Some("Always");
        let shape = PodShape {
            init: init.iter().map(|c| (c.name.clone(), sidecar(c))).collect(),
            app: spec.containers.iter().map(|c| c.name.clone()).collect(),
            policy: RestartPolicy::parse(spec.restart_policy.as_deref()),
        };
        let containers = init
            .into_iter()
            .map(|c| (c, true))
            .chain(spec.containers.iter().cloned().map(|c| (c, false)))
            .collect();
        let grace = Duration::from_secs(
            spec.termination_grace_period_seconds
                .and_then(|s| u64::try_from(s).ok())
                .unwrap_or(30),
        );
        let token = volumes::mint_token(&pod, Timestamp::now().as_second(), 3607, None);
        let config = &shared.config;
        let mut conditions = Conditions::default();
        conditions.set("PodScheduled", true, None);
        Worker {
            dir: config.root.join("pods").join(&uid),
            logs: config.logs.join(format!("{namespace}_{name}_{uid}")),
            backoff: Backoff::new(config.backoff_base, config.backoff_max),
            shared,
            pod,
            name,
            namespace,
            uid,
            containers,
            shape,
            grace,
            sandbox: None,
            sandbox_config: api::PodSandboxConfig::default(),
            sandbox_stopped: false,
            ip: None,
            volumes: PodVolumes::default(),
            volumes_ready: false,
            volume_error: None,
            token,
            token_at: Instant::now(),
            instances: HashMap::new(),
            waiting: HashMap::new(),
            retry_at: HashMap::new(),
            probes: HashMap::new(),
            probing: HashSet::new(),
            in_flight: JoinSet::new(),
            initialized: false,
            init_failed: false,
            failed: None,
            conditions,
            start_time: Time(Timestamp::now()),
            written: None,
        }
    }

    fn root(&self) -> bool {
        self.shared.config.mount && nix::unistd::geteuid().is_root()
    }

    /// Refuses what the test kubelet cannot run, naming it, before anything
    /// is made: images not on the node, probes and hooks it cannot run,
    /// `env` it does not resolve.
    fn check(&mut self) -> Result<(), String> {
        let images = &self.shared.config.images;
        for (c, _) in &self.containers {
            if !images.iter().any(|i| c.image.as_ref() == Some(i)) {
                return Err(format!(
                    "container {}: image {:?} is not on the node (the test kubelet pulls none; it \
                     runs {images:?})",
                    c.name, c.image
                ));
            }
            for kind in [Kind::Startup, Kind::Readiness, Kind::Liveness] {
                probes::probe_spec(c, kind)?;
            }
            probes::pre_stop(c)?;
            if c.env.iter().flatten().any(|e| e.value_from.is_some()) || c.env_from.is_some() {
                return Err(format!(
                    "container {}: env valueFrom and envFrom are not supported by the test kubelet",
                    c.name
                ));
            }
        }
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| format!("creating {}: {e}", self.dir.display()))?;
        std::fs::create_dir_all(&self.logs)
            .map_err(|e| format!("creating the log directory {}: {e}", self.logs.display()))?;
        self.volumes =
            volumes::create(&self.dir, &self.pod, self.root()).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Writes every configuration volume (a no-op for those unchanged).
    async fn write_volumes(&mut self) {
        if self.token_at.elapsed() >= self.shared.config.token_rotation {
            self.token = volumes::mint_token(&self.pod, Timestamp::now().as_second(), 3607, None);
            self.token_at = Instant::now();
            self.volumes_ready = false;
        }
        if self.volumes_ready {
            return;
        }
        let shared = self.shared.clone();
        if self.volume_error.is_none() && self.sandbox.is_none() {
            let ready = async {
                let _ = shared.config_maps.wait_until_ready().await;
                let _ = shared.secrets.wait_until_ready().await;
            };
            let _ = tokio::time::timeout(STORES_READY, ready).await;
        }
        let lookup = StoreLookup {
            shared: &shared,
            namespace: &self.namespace,
        };
        let mut error = None;
        for volume in self
            .pod
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
        {
            let written = volumes::payload(volume, &self.pod, &lookup, &self.token).and_then(|p| {
                match (p, self.volumes.paths.get(&volume.name)) {
                    (Some(p), Some(dir)) => AtomicWriter::new(dir)
                        .write(&p)
                        .map(drop)
                        .map_err(|e| format!("volume {:?}: {e}", volume.name)),
                    _ => Ok(()),
                }
            });
            if let Err(e) = written {
                tracing::warn!(pod = %self.name, "kubelet: {e}");
                error.get_or_insert(e);
            }
        }
        self.volumes_ready = error.is_none();
        self.volume_error = error;
    }

    /// One pass over the pod.
    async fn pass(&mut self) {
        self.write_volumes().await;
        if self.sandbox.is_none() {
            if self.volume_error.is_some() {
                return;
            }
            if let Err(e) = self.run_sandbox().await {
                self.failed = Some(e);
                return;
            }
        }
        self.refresh().await;
        self.start_probes();
        let states: HashMap<String, Tracked> = self
            .instances
            .iter()
            .map(|(n, i)| (n.clone(), i.tracked.clone()))
            .collect();
        let now = Instant::now();
        let plan = lifecycle::plan(&self.shape, &states, &mut self.backoff, now);
        self.initialized = plan.initialized;
        self.init_failed = plan.init_failed;
        self.waiting
            .retain(|_, (reason, _)| reason != "CrashLoopBackOff");
        let mut started_any = false;
        for action in plan.actions {
            match action {
                Action::Kill(name) => self.kill(&name).await,
                Action::BackOff(name, until) => {
                    let secs = until.saturating_duration_since(now).as_secs().max(1);
                    let message = format!(
                        "back-off {secs}s restarting failed container={name} pod={}_{}({})",
                        self.name, self.namespace, self.uid
                    );
                    self.retry_at.insert(name.clone(), until);
                    self.waiting
                        .insert(name, ("CrashLoopBackOff".into(), message));
                }
                Action::Start(name) => {
                    if self.retry_at.get(&name).is_some_and(|at| *at > now)
                        && !self.instances.contains_key(&name)
                    {
                        continue;
                    }
                    self.retry_at.remove(&name);
                    started_any = true;
                    if let Err((reason, message)) = self.start(&name).await {
                        tracing::warn!(pod = %self.name, container = %name, "kubelet: {reason}: {message}");
                        self.backoff.next(&format!("create/{name}"), now);
                        let until = self
                            .backoff
                            .until(&format!("create/{name}"), now, now)
                            .unwrap_or(now + self.shared.config.backoff_base);
                        self.retry_at.insert(name.clone(), until);
                        self.waiting.insert(name, (reason.into(), message));
                    }
                }
            }
        }
        if started_any {
            // What was started is reported as the runtime has it (its
            // start time, its image), as kubelet's PLEG reports it.
            self.refresh().await;
        } else {
            self.update_health();
        }
        let phase = self.phase();
        let running = self
            .instances
            .values()
            .any(|i| i.tracked.state == RunState::Running);
        if (phase == "Succeeded" || phase == "Failed") && !running && !self.sandbox_stopped {
            if let Some(id) = &self.sandbox {
                if let Err(e) = self.shared.cri.stop_pod_sandbox(id).await {
                    tracing::warn!(pod = %self.name, "kubelet: StopPodSandbox {id}: {e}");
                }
            }
            self.sandbox_stopped = true;
        }
    }

    async fn run_sandbox(&mut self) -> Result<(), String> {
        let spec = self.pod.spec.clone().unwrap_or_default();
        let meta = &self.pod.metadata;
        let mut config = twig_cri::pod_sandbox_config(&self.name, &self.uid, &self.logs);
        if let Some(m) = config.metadata.as_mut() {
            m.namespace = self.namespace.clone();
        }
        let (hostname, domain) = dns::hostname_and_domain(
            &spec,
            &self.name,
            &self.namespace,
            &self.shared.config.cluster_domain,
        );
        config.hostname = hostname.clone();
        config.dns_config = Some(dns::pod_dns(&spec, &self.namespace, &self.shared.dns));
        let host_network = spec.host_network == Some(true);
        if host_network {
            twig_cri::on_node_network(&mut config);
        }
        config.labels = meta
            .labels
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        config.labels.extend([
            ("io.kubernetes.pod.name".to_string(), self.name.clone()),
            (
                "io.kubernetes.pod.namespace".to_string(),
                self.namespace.clone(),
            ),
            ("io.kubernetes.pod.uid".to_string(), self.uid.clone()),
        ]);
        config.annotations = meta
            .annotations
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        // No runtimeClassName: CRI's default runtime, as kubelet asks for it.
        let handler = spec.runtime_class_name.clone().unwrap_or_default();
        let id = self
            .shared
            .cri
            .run_pod_sandbox(&config, &handler)
            .await
            .map_err(|e| format!("RunPodSandbox: {e}"))?;
        self.sandbox = Some(id.clone());
        self.sandbox_config = config;
        self.conditions.set("PodReadyToStartContainers", true, None);
        let aliases = spec.host_aliases.clone().unwrap_or_default();
        let hosts = if host_network {
            // A pod on the node's network has the node's address, which this
            // kubelet does not know: it reports none, and probes 127.0.0.1.
            let node = std::fs::read_to_string(&self.shared.config.node_hosts).unwrap_or_default();
            dns::node_hosts(&node, &aliases)
        } else {
            let ip = self
                .shared
                .cri
                .pod_ip(&id)
                .await
                .map_err(|e| format!("PodSandboxStatus: {e}"))?;
            self.ip = Some(ip);
            dns::managed_hosts(&[ip.to_string()], &hostname, &domain, &aliases)
        };
        let path = self.dir.join("etc-hosts");
        std::fs::write(&path, hosts).map_err(|e| format!("writing {}: {e}", path.display()))?;
        Ok(())
    }

    /// Reads every instance's state from CRI.
    async fn refresh(&mut self) {
        for (c, _) in &self.containers {
            let fallback = c.termination_message_policy.as_deref() == Some("FallbackToLogsOnError");
            let Some(i) = self.instances.get_mut(&c.name) else {
                continue;
            };
            if matches!(i.tracked.state, RunState::Exited(_)) {
                continue;
            }
            let s = match self.shared.cri.container_status(&i.id).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(pod = %self.name, container = %c.name, "kubelet: ContainerStatus: {e}");
                    continue;
                }
            };
            i.tracked.state = match api::ContainerState::try_from(s.state) {
                Ok(api::ContainerState::ContainerRunning) => RunState::Running,
                Ok(api::ContainerState::ContainerExited) => RunState::Exited(s.exit_code),
                _ => RunState::Created,
            };
            if let RunState::Exited(code) = i.tracked.state {
                let message =
                    status::termination_message(Some(&i.message_file), fallback, code, &i.log);
                i.terminated = Some(status::terminated(&s, message));
                i.tracked.finished_at = Some(Instant::now());
                i.ready = false;
                i.tracked.started = false;
                i.tracked.unhealthy = false;
            }
            i.cri = Some(s);
        }
        self.update_health();
    }

    /// Each instance's `started`, `ready` and `unhealthy` from its state
    /// and its probes' results.
    fn update_health(&mut self) {
        // Probe results of instances that are gone no longer count.
        let current: HashSet<&str> = self.instances.values().map(|i| i.id.as_str()).collect();
        self.probes
            .retain(|_, (id, _)| current.contains(id.as_str()));
        for (c, _) in &self.containers {
            let Some(i) = self.instances.get_mut(&c.name) else {
                continue;
            };
            // Only this instance's workers: a container started in this
            // pass has none yet, and its probes hold their initial results.
            let id = i.id.clone();
            let probes = &self.probes;
            let worker = |kind| {
                probes
                    .get(&(c.name.clone(), kind))
                    .filter(|(of, _)| *of == id)
                    .map(|(_, w)| w)
            };
            let h = probes::health(c, i.tracked.state == RunState::Running, worker);
            i.tracked.started = h.started;
            i.ready = h.ready;
            i.tracked.unhealthy = h.unhealthy;
        }
    }

    /// Starts the probes that are due, and the workers of new instances.
    fn start_probes(&mut self) {
        let now = Instant::now();
        let target = self.ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        for (c, _) in &self.containers {
            let Some(i) = self.instances.get(&c.name) else {
                continue;
            };
            if i.tracked.state != RunState::Running {
                continue;
            }
            for kind in [Kind::Startup, Kind::Readiness, Kind::Liveness] {
                let Ok(Some(spec)) = probes::probe_spec(c, kind) else {
                    continue;
                };
                let key = (c.name.clone(), kind);
                let entry = self
                    .probes
                    .entry(key.clone())
                    .or_insert_with(|| (i.id.clone(), probes::Worker::new(spec, now)));
                if kind != Kind::Startup && !i.tracked.started {
                    continue;
                }
                if !entry.1.due(now) || self.probing.contains(&key) {
                    continue;
                }
                self.probing.insert(key);
                let (cri, id, name) = (self.shared.cri.clone(), i.id.clone(), c.name.clone());
                let (handler, timeout) = (entry.1.spec.handler.clone(), entry.1.spec.timeout);
                self.in_flight.spawn(async move {
                    let result = probes::run(&handler, &cri, &id, target, timeout).await;
                    (name, kind, id, result)
                });
            }
        }
    }

    /// Records a probe's answer.
    fn probed(&mut self, name: &str, kind: Kind, id: &str, result: Result<(), String>) {
        self.probing.remove(&(name.to_string(), kind));
        let Some((worker_id, worker)) = self.probes.get_mut(&(name.to_string(), kind)) else {
            return;
        };
        if worker_id != id {
            return;
        }
        if let Err(e) = &result {
            tracing::info!(pod = %self.name, container = name, "kubelet: {kind:?} probe failed: {e}");
        }
        worker.record(result.is_ok(), Instant::now());
    }

    /// Creates and starts a new instance of container `name`.
    async fn start(&mut self, name: &str) -> Result<(), (&'static str, String)> {
        let Some((c, _)) = self
            .containers
            .iter()
            .find(|(c, _)| c.name == name)
            .cloned()
        else {
            return Ok(());
        };
        let sandbox = self.sandbox.clone().unwrap_or_default();
        let attempt = self.instances.get(name).map_or(0, |i| i.attempt + 1);
        let create_error = |e: String| ("CreateContainerConfigError", e);
        let container_dir = self.dir.join("containers").join(name);
        std::fs::create_dir_all(&container_dir).map_err(|e| create_error(e.to_string()))?;
        let message_file = container_dir.join(format!("{:08x}", random_u32()));
        let image = c.image.clone().unwrap_or_default();
        let log_rel = format!("{name}/{attempt}.log");
        std::fs::create_dir_all(self.logs.join(name)).map_err(|e| create_error(e.to_string()))?;
        let mut config = twig_cri::container_config(name, &image, &[], &log_rel);
        if let Some(m) = config.metadata.as_mut() {
            m.attempt = attempt;
        }
        config.command = c.command.clone().unwrap_or_default();
        config.args = c.args.clone().unwrap_or_default();
        config.working_dir = c.working_dir.clone().unwrap_or_default();
        config.tty = c.tty == Some(true);
        config.stdin = c.stdin == Some(true);
        config.stdin_once = c.stdin_once == Some(true);
        config.envs = c
            .env
            .iter()
            .flatten()
            .map(|e| api::KeyValue {
                key: e.name.clone(),
                value: e.value.clone().unwrap_or_default(),
            })
            .collect();
        let root = self.root();
        let mut mounts =
            volumes::container_mounts(&self.dir, &self.pod, &c, &mut self.volumes, root)
                .map_err(|e| create_error(e.to_string()))?;
        if !mounts.iter().any(|m| m.container_path == "/etc/hosts") {
            mounts.push(api::Mount {
                container_path: "/etc/hosts".into(),
                host_path: self.dir.join("etc-hosts").to_string_lossy().into_owned(),
                ..Default::default()
            });
        }
        let message_path = c
            .termination_message_path
            .clone()
            .unwrap_or_else(|| "/dev/termination-log".into());
        if !message_path.is_empty() {
            std::fs::write(&message_file, b"").map_err(|e| create_error(e.to_string()))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&message_file, std::fs::Permissions::from_mode(0o666))
                .map_err(|e| create_error(e.to_string()))?;
            mounts.push(api::Mount {
                container_path: message_path.clone(),
                host_path: message_file.to_string_lossy().into_owned(),
                ..Default::default()
            });
        }
        config.mounts = mounts;
        config.labels = [
            ("io.kubernetes.container.name", name),
            ("io.kubernetes.pod.name", &self.name),
            ("io.kubernetes.pod.namespace", &self.namespace),
            ("io.kubernetes.pod.uid", &self.uid),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        config.annotations = [
            ("io.kubernetes.container.restartCount", attempt.to_string()),
            (
                "io.kubernetes.container.terminationMessagePath",
                message_path,
            ),
            (
                "io.kubernetes.pod.terminationGracePeriod",
                self.grace.as_secs().to_string(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let cri = &self.shared.cri;
        let id = cri
            .create_container(&sandbox, &config, &self.sandbox_config)
            .await
            .map_err(|e| ("CreateContainerError", e.to_string()))?;
        let previous = self.instances.remove(name);
        // kubelet keeps the one dead instance before this one.
        if let Some((old, _)) = previous.as_ref().and_then(|p| p.previous.as_ref()) {
            if let Err(e) = cri.remove_container(old).await {
                tracing::warn!(pod = %self.name, "kubelet: RemoveContainer {old}: {e}");
            }
        }
        let started = cri.start_container(&id).await;
        self.waiting.remove(name);
        self.instances.insert(
            name.to_string(),
            Instance {
                id: id.clone(),
                attempt,
                cri: None,
                tracked: Tracked {
                    state: if started.is_ok() {
                        RunState::Running
                    } else {
                        RunState::Created
                    },
                    finished_at: None,
                    started: false,
                    unhealthy: false,
                },
                message_file,
                log: self.logs.join(&log_rel),
                terminated: None,
                previous: previous.map(|p| (p.id, p.terminated)),
                ready: false,
            },
        );
        // A failed start leaves an exited container, restarted like any.
        started.map_err(|e| ("RunContainerError", e.to_string()))
    }

    /// Runs `name`'s preStop hook, then stops it within the grace period.
    async fn kill(&mut self, name: &str) {
        let Some(i) = self.instances.get(name) else {
            return;
        };
        let c = self
            .containers
            .iter()
            .find(|(c, _)| c.name == name)
            .map(|(c, _)| c.clone());
        let target = self.ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        stop_container(&self.shared, c.as_ref(), &i.id, target, self.grace).await;
    }

    fn phase(&self) -> &'static str {
        if self.failed.is_some() {
            return "Failed";
        }
        let states: HashMap<String, Tracked> = self
            .instances
            .iter()
            .map(|(n, i)| (n.clone(), i.tracked.clone()))
            .collect();
        lifecycle::phase(&self.shape, &states, self.initialized, self.init_failed)
    }

    /// The status of container `c`.
    fn container_status(&self, c: &Container, init: bool) -> ContainerStatus {
        let image = c.image.clone().unwrap_or_default();
        let Some(i) = self.instances.get(&c.name) else {
            let (reason, message) = match self.waiting.get(&c.name) {
                Some((r, m)) => (r.as_str(), m.as_str()),
                None if !init && !self.initialized => ("PodInitializing", ""),
                None => (
                    "ContainerCreating",
                    self.volume_error.as_deref().unwrap_or_default(),
                ),
            };
            return ContainerStatus {
                name: c.name.clone(),
                image,
                state: Some(status::state(None, None, Some((reason, message)))),
                ready: false,
                started: Some(false),
                ..Default::default()
            };
        };
        let last_previous = i.previous.as_ref().and_then(|(_, t)| t.clone());
        let crash_looping = self.waiting.get(&c.name).filter(|_| i.terminated.is_some());
        let (state, last) = match crash_looping {
            Some((r, m)) => (
                status::state(None, None, Some((r, m))),
                i.terminated.clone(),
            ),
            None => {
                let running_since = (i.tracked.state == RunState::Running)
                    .then(|| i.cri.as_ref().map_or(0, |s| s.started_at));
                (
                    status::state(running_since, i.terminated.clone(), None),
                    last_previous,
                )
            }
        };
        ContainerStatus {
            name: c.name.clone(),
            image,
            image_id: i
                .cri
                .as_ref()
                .map(|s| s.image_ref.clone())
                .unwrap_or_default(),
            container_id: Some(format!("{CONTAINER_ID_PREFIX}{}", i.id)),
            ready: i.ready,
            started: Some(i.tracked.started),
            restart_count: i32::try_from(i.attempt).unwrap_or(i32::MAX),
            state: Some(state),
            last_state: last.map(|t| k8s_openapi::api::core::v1::ContainerState {
                terminated: Some(t),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Writes the pod's status when it changed.
    async fn write_status(&mut self) {
        // Nothing to say before the first pass got anywhere.
        if self.failed.is_none() && self.sandbox.is_none() && self.volume_error.is_none() {
            return;
        }
        let phase = self.phase();
        let init: Vec<ContainerStatus> = self
            .containers
            .iter()
            .filter(|(_, init)| *init)
            .map(|(c, _)| self.container_status(c, true))
            .collect();
        let app: Vec<ContainerStatus> = self
            .containers
            .iter()
            .filter(|(_, init)| !*init)
            .map(|(c, _)| self.container_status(c, false))
            .collect();
        let ready = !app.is_empty() && app.iter().all(|c| c.ready);
        let done = phase == "Succeeded" || phase == "Failed";
        self.conditions.set(
            "Initialized",
            self.initialized || done,
            (!self.initialized).then_some("ContainersNotInitialized"),
        );
        let not_ready = if done {
            "PodCompleted"
        } else {
            "ContainersNotReady"
        };
        self.conditions.set(
            "ContainersReady",
            ready && !done,
            (!ready || done).then_some(not_ready),
        );
        self.conditions.set(
            "Ready",
            ready && !done,
            (!ready || done).then_some(not_ready),
        );
        if self.sandbox_stopped {
            self.conditions
                .set("PodReadyToStartContainers", false, None);
        }
        let ip = self.ip.map(|ip| ip.to_string());
        let pod_status = PodStatus {
            phase: Some(phase.into()),
            pod_ips: ip.clone().map(|ip| vec![PodIP { ip }]),
            pod_ip: ip,
            start_time: Some(self.start_time.clone()),
            container_statuses: Some(app),
            init_container_statuses: (!init.is_empty()).then_some(init),
            conditions: Some(self.conditions.list()),
            reason: self.failed.as_ref().map(|_| "TestKubelet".into()),
            message: self.failed.clone(),
            ..Default::default()
        };
        let mut value = serde_json::to_value(&pod_status).unwrap_or_default();
        for field in ["reason", "message", "initContainerStatuses"] {
            if value.get(field).is_none() {
                value[field] = Value::Null;
            }
        }
        if self.written.as_ref() == Some(&value) {
            return;
        }
        let pods: Api<Pod> = Api::namespaced(self.shared.client.clone(), &self.namespace);
        let patch = Patch::Merge(json!({ "status": value }));
        match pods
            .patch_status(&self.name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => self.written = Some(value),
            Err(e) => tracing::warn!(pod = %self.name, "kubelet: writing the status: {e}"),
        }
    }

    /// When the next pass is due.
    fn next_wake(&self) -> Instant {
        let now = Instant::now();
        let mut wake = now + self.shared.config.sync_period;
        // Only future times: a probe already due waits for its container
        // (or its answer), a retry already due for the plan to reach it.
        for (_, w) in self.probes.values() {
            if w.next_at() > now && w.due(w.next_at()) {
                wake = wake.min(w.next_at());
            }
        }
        for at in self.retry_at.values().filter(|at| **at > now) {
            wake = wake.min(*at);
        }
        wake.min(self.token_at + self.shared.config.token_rotation)
    }

    /// Stops the pod: app containers first, then init containers (sidecars),
    /// each with its preStop hook within the grace period; then the sandbox,
    /// the pod's mounts and its directory.
    async fn stop(mut self) {
        self.in_flight.abort_all();
        let target = self.ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        for init in [false, true] {
            let stops = self
                .containers
                .iter()
                .filter(|(_, i)| *i == init)
                .filter_map(|(c, _)| {
                    let i = self.instances.get(&c.name)?;
                    (i.tracked.state == RunState::Running)
                        .then(|| stop_container(&self.shared, Some(c), &i.id, target, self.grace))
                });
            futures::future::join_all(stops).await;
        }
        if let Some(id) = &self.sandbox {
            if let Err(e) = self.shared.cri.stop_pod_sandbox(id).await {
                tracing::warn!(pod = %self.name, "kubelet: StopPodSandbox {id}: {e}");
            }
            if let Err(e) = self.shared.cri.remove_pod_sandbox(id).await {
                tracing::warn!(pod = %self.name, "kubelet: RemovePodSandbox {id}: {e}");
            }
        }
        volumes::unmount(&self.volumes);
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(pod = %self.name, "kubelet: removing {}: {e}", self.dir.display());
        }
    }
}

/// kubelet's `killContainer`: the preStop hook, then `StopContainer` with
/// what is left of the grace period (at least 2 s).
async fn stop_container(
    shared: &Shared,
    c: Option<&Container>,
    id: &str,
    target: IpAddr,
    grace: Duration,
) {
    let started = Instant::now();
    if let Some(Ok(Some(hook))) = c.map(probes::pre_stop) {
        let timeout = match &hook {
            Handler::Sleep(d) => (*d).min(grace),
            _ => grace,
        };
        let run = probes::run(&hook, &shared.cri, id, target, timeout);
        match tokio::time::timeout(grace, run).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("kubelet: preStop hook of {id}: {e}"),
            Err(_) => tracing::warn!("kubelet: preStop hook of {id} ran past the grace period"),
        }
    }
    let left = grace.saturating_sub(started.elapsed()).max(MIN_STOP_GRACE);
    if let Err(e) = shared.cri.stop_container(id, left).await {
        tracing::warn!("kubelet: StopContainer {id}: {e}");
    }
}
