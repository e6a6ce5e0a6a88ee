//! Confining NIXL's UCX to one network interface, for the gateway (the interface of its
//! `--listen` address) and a NIXL producer (the interface its route to the gateway leaves by):
//! UCX left alone listens on every interface, with no token on its data path.

/// The interface holding `ip`: `lo` for a loopback address, else the one `getifaddrs` lists
/// with it; `None` for an address that is every interface, or one no interface has.
pub fn interface_of(ip: std::net::IpAddr) -> Option<String> {
    if ip.is_unspecified() {
        return None;
    }
    let found = nix::ifaddrs::getifaddrs().ok()?.find(|i| {
        i.address.as_ref().is_some_and(|a| {
            a.as_sockaddr_in().map(|v4| std::net::IpAddr::V4(v4.ip())) == Some(ip)
                || a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())) == Some(ip)
        })
    });
    match found {
        Some(i) => Some(i.interface_name),
        None if ip.is_loopback() => Some("lo".into()),
        None => None,
    }
}

/// The interface this host reaches `gateway` (`http[s]://HOST:PORT`) by: the one holding the
/// source address the kernel picks for it (a UDP socket connected there; nothing is sent).
pub fn interface_towards(gateway: &str) -> Option<String> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let uri = gateway.parse::<tonic::codegen::http::Uri>().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(80);
    let to = (host, port).to_socket_addrs().ok()?.next()?;
    let any: std::net::SocketAddr = match to {
        std::net::SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        std::net::SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = UdpSocket::bind(any).ok()?;
    s.connect(to).ok()?;
    interface_of(s.local_addr().ok()?.ip())
}

/// Confines UCX (NIXL's transport, in this process) to `iface` through `UCX_NET_DEVICES`,
/// unless the operator set that; says which applies. Called before any thread that reads the
/// environment starts.
pub fn confine(iface: Option<&str>) {
    match (std::env::var("UCX_NET_DEVICES"), iface) {
        (Ok(set), _) => tracing::info!("NIXL's UCX uses UCX_NET_DEVICES={set} as set"),
        (Err(_), Some(iface)) => {
            // No other thread reads the environment yet.
            std::env::set_var("UCX_NET_DEVICES", iface);
            tracing::info!("NIXL's UCX is confined to {iface}")
        }
        (Err(_), None) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_gateway_is_reached_by_loopback() {
        assert_eq!(
            interface_towards("http://127.0.0.1:50051").as_deref(),
            Some("lo")
        );
        assert_eq!(
            interface_towards("https://localhost:8443").as_deref(),
            Some("lo")
        );
        assert_eq!(interface_towards("not a url"), None);
        assert_eq!(interface_of("0.0.0.0".parse().unwrap()), None);
    }
}
