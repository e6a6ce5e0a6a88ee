//! TLS for the bridge's gRPC connections (rustls, through tonic): the gateway's certificate and
//! key, and optionally a CA whose client certificates it requires (mutual TLS); a remote
//! producer's CA to check the gateway, and optionally its own certificate.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A PEM file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {path}: {source}")]
pub struct PemError {
    path: String,
    #[source]
    source: std::io::Error,
}

fn pem(path: &Path) -> Result<Vec<u8>, PemError> {
    std::fs::read(path).map_err(|source| PemError {
        path: path.display().to_string(),
        source,
    })
}

/// The gateway's side.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// Its certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// If set, clients must present a certificate signed by this CA (PEM).
    pub client_ca: Option<PathBuf>,
}

impl ServerTls {
    /// tonic's configuration for it.
    pub fn config(&self) -> Result<ServerTlsConfig, PemError> {
        let mut c =
            ServerTlsConfig::new().identity(Identity::from_pem(pem(&self.cert)?, pem(&self.key)?));
        if let Some(ca) = &self.client_ca {
            c = c.client_ca_root(Certificate::from_pem(pem(ca)?));
        }
        Ok(c)
    }
}

/// A remote producer's side.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// The CA that signed the gateway's certificate (PEM).
    pub ca: Option<PathBuf>,
    /// The name the gateway's certificate must carry, if not the host of the address.
    pub domain: Option<String>,
    /// This producer's certificate and key (PEM), for a gateway that requires them.
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl ClientTls {
    /// tonic's configuration for it.
    pub fn config(&self) -> Result<ClientTlsConfig, PemError> {
        let mut c = ClientTlsConfig::new();
        if let Some(ca) = &self.ca {
            c = c.ca_certificate(Certificate::from_pem(pem(ca)?));
        }
        if let Some(d) = &self.domain {
            c = c.domain_name(d.clone());
        }
        if let Some((cert, key)) = &self.identity {
            c = c.identity(Identity::from_pem(pem(cert)?, pem(key)?));
        }
        Ok(c)
    }
}
