//! An ergonomic CRI v1 client over a Unix socket: one method per call the
//! tests and benchmarks make, each bounded by a deadline.

use crate::api;
use crate::api::image_service_client::ImageServiceClient;
use crate::api::runtime_service_client::RuntimeServiceClient;
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint, Uri};

/// The deadline of every call unless [`CriClient::with_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// What went wrong talking to a CRI runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket did not accept a gRPC connection.
    #[error("connecting to the CRI socket {socket}: {reason}")]
    Connect {
        /// The socket the client dialled.
        socket: PathBuf,
        /// Why the connection failed, with every cause.
        reason: String,
    },
    /// The runtime answered the call with an error status.
    #[error("CRI {call} failed: {code:?}: {message}")]
    Rpc {
        /// The CRI call, e.g. `RunPodSandbox`.
        call: &'static str,
        /// The gRPC status code.
        code: tonic::Code,
        /// The runtime's message.
        message: String,
    },
    /// The runtime did not answer within the deadline.
    #[error("CRI {call} did not answer within {after:?}")]
    Timeout {
        /// The CRI call.
        call: &'static str,
        /// The deadline that passed.
        after: Duration,
    },
    /// The answer lacked a field the call needs.
    #[error("CRI {call} answered without {what}")]
    Incomplete {
        /// The CRI call.
        call: &'static str,
        /// The missing field.
        what: &'static str,
    },
    /// The pod sandbox's status carries no parsable IP address.
    #[error("pod sandbox {id} has no usable IP address (status says {ip:?})")]
    NoPodIp {
        /// The pod sandbox.
        id: String,
        /// The IP field as the runtime reported it.
        ip: String,
    },
}

impl Error {
    /// The gRPC status code when the runtime answered with an error.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Error::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// The output of [`CriClient::exec_sync`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Everything the command wrote to stdout.
    pub stdout: Vec<u8>,
    /// Everything the command wrote to stderr.
    pub stderr: Vec<u8>,
    /// The command's exit code.
    pub exit_code: i32,
}

/// A CRI v1 client: the runtime and image services on one connection.
#[derive(Clone)]
pub struct CriClient {
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    timeout: Duration,
}

impl CriClient {
    /// Connects to the CRI endpoint at `socket` (e.g. containerd's socket).
    pub async fn connect(socket: &Path) -> Result<CriClient, Error> {
        let path = socket.to_path_buf();
        let channel = Endpoint::from_static("http://localhost")
            .connect_timeout(DEFAULT_TIMEOUT)
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await
            .map_err(|e| Error::Connect {
                socket: socket.to_path_buf(),
                reason: error_chain(&e),
            })?;
        Ok(CriClient {
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// The same client with another deadline for every call.
    pub fn with_timeout(mut self, timeout: Duration) -> CriClient {
        self.timeout = timeout;
        self
    }

    /// The runtime's name and version (`Version`).
    pub async fn version(&self) -> Result<api::VersionResponse, Error> {
        let req = api::VersionRequest {
            version: "v1".into(),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call("Version", t, rt.version(request(req, t))).await
    }

    /// Whether the runtime says its pod network is ready (`Status`, the
    /// condition `NetworkReady`): false until the CRI plugin has loaded a
    /// CNI configuration.
    pub async fn network_ready(&self) -> Result<bool, Error> {
        let req = api::StatusRequest { verbose: false };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        let resp = call("Status", t, rt.status(request(req, t))).await?;
        Ok(resp
            .status
            .iter()
            .flat_map(|s| &s.conditions)
            .any(|c| c.r#type == "NetworkReady" && c.status))
    }

    /// Pulls `image` (`PullImage`); returns the image reference the runtime
    /// resolved it to.
    pub async fn pull_image(&self, image: &str) -> Result<String, Error> {
        let req = api::PullImageRequest {
            image: Some(image_spec(image)),
            ..Default::default()
        };
        let (mut im, t) = (self.images.clone(), self.timeout);
        let resp = call("PullImage", t, im.pull_image(request(req, t))).await?;
        Ok(resp.image_ref)
    }

    /// Pulls `image` with the registry login `auth` (`PullImage`'s
    /// `auth`, as kubelet passes a pod's pull secret); returns the image
    /// reference the runtime resolved it to. `auth` is a secret: it is
    /// neither logged nor part of the error.
    pub async fn pull_image_with_auth(
        &self,
        image: &str,
        auth: api::AuthConfig,
    ) -> Result<String, Error> {
        let req = api::PullImageRequest {
            image: Some(image_spec(image)),
            auth: Some(auth),
            ..Default::default()
        };
        let (mut im, t) = (self.images.clone(), self.timeout);
        let resp = call("PullImage", t, im.pull_image(request(req, t))).await?;
        Ok(resp.image_ref)
    }

    /// Whether the runtime holds `image` already (`ImageStatus`), as
    /// kubelet checks before it pulls with the `IfNotPresent` policy.
    pub async fn image_present(&self, image: &str) -> Result<bool, Error> {
        let req = api::ImageStatusRequest {
            image: Some(image_spec(image)),
            verbose: false,
        };
        let (mut im, t) = (self.images.clone(), self.timeout);
        let resp = call("ImageStatus", t, im.image_status(request(req, t))).await?;
        Ok(resp.image.is_some())
    }

    /// The id of the image the runtime holds as `image` (`ImageStatus`),
    /// none when it holds none: two names of one image give one id.
    pub async fn image_id(&self, image: &str) -> Result<Option<String>, Error> {
        let req = api::ImageStatusRequest {
            image: Some(image_spec(image)),
            verbose: false,
        };
        let (mut im, t) = (self.images.clone(), self.timeout);
        let resp = call("ImageStatus", t, im.image_status(request(req, t))).await?;
        Ok(resp.image.map(|i| i.id))
    }

    /// Starts a pod sandbox with the runtime handler `handler` (`runc`,
    /// later `twig`); returns its id.
    pub async fn run_pod_sandbox(
        &self,
        config: &api::PodSandboxConfig,
        handler: &str,
    ) -> Result<String, Error> {
        let req = api::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.into(),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        let resp = call("RunPodSandbox", t, rt.run_pod_sandbox(request(req, t))).await?;
        Ok(resp.pod_sandbox_id)
    }

    /// The pod sandbox's status (`PodSandboxStatus`).
    pub async fn pod_sandbox_status(&self, id: &str) -> Result<api::PodSandboxStatus, Error> {
        let req = api::PodSandboxStatusRequest {
            pod_sandbox_id: id.into(),
            verbose: false,
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call(
            "PodSandboxStatus",
            t,
            rt.pod_sandbox_status(request(req, t)),
        )
        .await?
        .status
        .ok_or(Error::Incomplete {
            call: "PodSandboxStatus",
            what: "status",
        })
    }

    /// The pod's primary IP address, from its sandbox status.
    pub async fn pod_ip(&self, id: &str) -> Result<IpAddr, Error> {
        let status = self.pod_sandbox_status(id).await?;
        let ip = status.network.map(|n| n.ip).unwrap_or_default();
        ip.parse().map_err(|_| Error::NoPodIp { id: id.into(), ip })
    }

    /// Every pod sandbox the runtime knows (`ListPodSandbox`).
    pub async fn list_pod_sandboxes(&self) -> Result<Vec<api::PodSandbox>, Error> {
        let req = api::ListPodSandboxRequest { filter: None };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        Ok(
            call("ListPodSandbox", t, rt.list_pod_sandbox(request(req, t)))
                .await?
                .items,
        )
    }

    /// The containers of pod sandbox `sandbox` (`ListContainers` filtered
    /// by sandbox id).
    pub async fn list_containers(&self, sandbox: &str) -> Result<Vec<api::Container>, Error> {
        let req = api::ListContainersRequest {
            filter: Some(api::ContainerFilter {
                pod_sandbox_id: sandbox.to_string(),
                ..Default::default()
            }),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        Ok(
            call("ListContainers", t, rt.list_containers(request(req, t)))
                .await?
                .containers,
        )
    }

    /// Stops every container of the pod sandbox and the sandbox itself.
    pub async fn stop_pod_sandbox(&self, id: &str) -> Result<(), Error> {
        let req = api::StopPodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call("StopPodSandbox", t, rt.stop_pod_sandbox(request(req, t))).await?;
        Ok(())
    }

    /// Removes the pod sandbox and its containers.
    pub async fn remove_pod_sandbox(&self, id: &str) -> Result<(), Error> {
        let req = api::RemovePodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call(
            "RemovePodSandbox",
            t,
            rt.remove_pod_sandbox(request(req, t)),
        )
        .await?;
        Ok(())
    }

    /// Creates a container in the pod sandbox `pod_id`, which was started
    /// from `sandbox`; returns the container's id.
    pub async fn create_container(
        &self,
        pod_id: &str,
        config: &api::ContainerConfig,
        sandbox: &api::PodSandboxConfig,
    ) -> Result<String, Error> {
        let req = api::CreateContainerRequest {
            pod_sandbox_id: pod_id.into(),
            config: Some(config.clone()),
            sandbox_config: Some(sandbox.clone()),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        let resp = call("CreateContainer", t, rt.create_container(request(req, t))).await?;
        Ok(resp.container_id)
    }

    /// Starts a created container.
    pub async fn start_container(&self, id: &str) -> Result<(), Error> {
        let req = api::StartContainerRequest {
            container_id: id.into(),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call("StartContainer", t, rt.start_container(request(req, t))).await?;
        Ok(())
    }

    /// Runs `cmd` in the container and waits for it, at most `timeout`
    /// (which is also the runtime's own limit for the command).
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[&str],
        timeout: Duration,
    ) -> Result<ExecOutput, Error> {
        let req = api::ExecSyncRequest {
            container_id: id.into(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX).max(1),
        };
        // The runtime's limit plus some slack for the call itself.
        let t = timeout + self.timeout;
        let mut rt = self.runtime.clone();
        let resp = call("ExecSync", t, rt.exec_sync(request(req, t))).await?;
        Ok(ExecOutput {
            stdout: resp.stdout,
            stderr: resp.stderr,
            exit_code: resp.exit_code,
        })
    }

    /// The streaming URL of an exec of `cmd` in container `id` (CRI's
    /// `Exec`: the runtime's streaming server runs it once a client
    /// connects, SPDY or WebSocket as kubelet's clients do).
    pub async fn exec_url(
        &self,
        id: &str,
        cmd: &[&str],
        stdin: bool,
        tty: bool,
    ) -> Result<String, Error> {
        let req = api::ExecRequest {
            container_id: id.into(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            tty,
            stdin,
            stdout: true,
            stderr: !tty,
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        Ok(call("Exec", t, rt.exec(request(req, t))).await?.url)
    }

    /// The streaming URL that attaches to container `id`'s own stdio (CRI's
    /// `Attach`, `kubectl attach`).
    pub async fn attach_url(&self, id: &str, stdin: bool) -> Result<String, Error> {
        let req = api::AttachRequest {
            container_id: id.into(),
            stdin,
            tty: false,
            stdout: true,
            stderr: true,
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        Ok(call("Attach", t, rt.attach(request(req, t))).await?.url)
    }

    /// The streaming URL that forwards `ports` of pod sandbox `pod_id`
    /// (CRI's `PortForward`, `kubectl port-forward`).
    pub async fn port_forward_url(&self, pod_id: &str, ports: &[u16]) -> Result<String, Error> {
        let req = api::PortForwardRequest {
            pod_sandbox_id: pod_id.into(),
            port: ports.iter().map(|p| i32::from(*p)).collect(),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        Ok(call("PortForward", t, rt.port_forward(request(req, t)))
            .await?
            .url)
    }

    /// The container's resource usage (`ContainerStats`).
    pub async fn container_stats(&self, id: &str) -> Result<api::ContainerStats, Error> {
        let req = api::ContainerStatsRequest {
            container_id: id.into(),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call("ContainerStats", t, rt.container_stats(request(req, t)))
            .await?
            .stats
            .ok_or(Error::Incomplete {
                call: "ContainerStats",
                what: "stats",
            })
    }

    /// The container's status (`ContainerStatus`).
    pub async fn container_status(&self, id: &str) -> Result<api::ContainerStatus, Error> {
        let req = api::ContainerStatusRequest {
            container_id: id.into(),
            verbose: false,
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call("ContainerStatus", t, rt.container_status(request(req, t)))
            .await?
            .status
            .ok_or(Error::Incomplete {
                call: "ContainerStatus",
                what: "status",
            })
    }

    /// Changes a container's resources in place (`UpdateContainerResources`,
    /// what kubelet's in-place resize calls).
    pub async fn update_container_resources(
        &self,
        id: &str,
        linux: api::LinuxContainerResources,
    ) -> Result<(), Error> {
        let req = api::UpdateContainerResourcesRequest {
            container_id: id.into(),
            linux: Some(linux),
            ..Default::default()
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call(
            "UpdateContainerResources",
            t,
            rt.update_container_resources(request(req, t)),
        )
        .await?;
        Ok(())
    }

    /// Stops the container: SIGTERM, then SIGKILL after `grace`.
    pub async fn stop_container(&self, id: &str, grace: Duration) -> Result<(), Error> {
        let req = api::StopContainerRequest {
            container_id: id.into(),
            timeout: i64::try_from(grace.as_secs()).unwrap_or(i64::MAX),
        };
        let t = grace + self.timeout;
        let mut rt = self.runtime.clone();
        call("StopContainer", t, rt.stop_container(request(req, t))).await?;
        Ok(())
    }

    /// Removes a stopped container.
    pub async fn remove_container(&self, id: &str) -> Result<(), Error> {
        let req = api::RemoveContainerRequest {
            container_id: id.into(),
        };
        let (mut rt, t) = (self.runtime.clone(), self.timeout);
        call("RemoveContainer", t, rt.remove_container(request(req, t))).await?;
        Ok(())
    }
}

/// An image spec naming `image`.
pub fn image_spec(image: &str) -> api::ImageSpec {
    api::ImageSpec {
        image: image.into(),
        ..Default::default()
    }
}

/// Puts the pod on the node's network namespace, as kubelet asks for a pod
/// with `hostNetwork: true`.
pub fn on_node_network(config: &mut api::PodSandboxConfig) {
    config.linux = Some(api::LinuxPodSandboxConfig {
        security_context: Some(api::LinuxSandboxSecurityContext {
            namespace_options: Some(api::NamespaceOption {
                network: api::NamespaceMode::Node as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
}

/// A pod sandbox config with the fields kubelet always sets: metadata,
/// hostname, the log directory CRI writes container logs under.
pub fn pod_sandbox_config(name: &str, uid: &str, log_directory: &Path) -> api::PodSandboxConfig {
    api::PodSandboxConfig {
        metadata: Some(api::PodSandboxMetadata {
            name: name.into(),
            uid: uid.into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        hostname: name.into(),
        log_directory: log_directory.to_string_lossy().into_owned(),
        linux: Some(api::LinuxPodSandboxConfig::default()),
        ..Default::default()
    }
}

/// A container config: `image` running `command` (an empty command runs
/// the image's own), logging to `log_path` under the pod's log directory.
pub fn container_config(
    name: &str,
    image: &str,
    command: &[&str],
    log_path: &str,
) -> api::ContainerConfig {
    api::ContainerConfig {
        metadata: Some(api::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(image_spec(image)),
        command: command.iter().map(|s| s.to_string()).collect(),
        log_path: log_path.into(),
        linux: Some(api::LinuxContainerConfig::default()),
        ..Default::default()
    }
}

/// An error and its causes, `: `-separated.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s = format!("{s}: {c}");
        cause = c.source();
    }
    s
}

fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.set_timeout(timeout);
    req
}

/// Awaits one call with a client-side deadline too (the server may ignore
/// `grpc-timeout`), and names the call in its error.
async fn call<T>(
    name: &'static str,
    timeout: Duration,
    fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, fut).await {
        Err(_) => Err(Error::Timeout {
            call: name,
            after: timeout,
        }),
        Ok(Err(status)) => Err(Error::Rpc {
            call: name,
            code: status.code(),
            message: status.message().to_string(),
        }),
        Ok(Ok(resp)) => Ok(resp.into_inner()),
    }
}
