//! Where a NIXL reader process may connect. UCX connects wherever the producer's metadata says
//! (a worker address names hosts and ports), so a token holder could point the gateway's host
//! at any service it reaches. The reader process is therefore confined to the address the
//! producer authenticated from: this executable defines `connect(2)` itself, exported to the
//! libraries it loads at run time (build.rs), and that definition checks an internet address
//! against the allowed ones before making the system call. Unconfined (every other subcommand)
//! it passes every call through unchanged.
//!
//! Local sockets (`AF_UNIX`, netlink) and `AF_UNSPEC` (which dissolves a datagram association)
//! pass; an internet address passes if its IP is allowed (an IPv4-mapped IPv6 address as its
//! IPv4 one); anything else fails with `EACCES`, and the last refused address is kept for the
//! reader's error message.
#![allow(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Mutex, OnceLock};

use nix::libc;

static ALLOWED: OnceLock<Vec<IpAddr>> = OnceLock::new();
static REFUSED: Mutex<Option<SocketAddr>> = Mutex::new(None);

/// Confines this process's connections to `ips` from now on (only the first call counts).
pub fn only(ips: &[IpAddr]) {
    let _ = ALLOWED.set(ips.iter().map(|ip| ip.to_canonical()).collect());
}

/// The last connection refused, if any.
pub fn refused() -> Option<SocketAddr> {
    *REFUSED.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a connection to `addr` may do under `allowed`: `Ok` to go ahead, `Err` with the
/// internet address it names when refused (`None` for a family that is not allowed at all).
fn check(
    allowed: &[IpAddr],
    family: i32,
    inet: Option<SocketAddr>,
) -> Result<(), Option<SocketAddr>> {
    match family {
        libc::AF_UNIX | libc::AF_NETLINK | libc::AF_UNSPEC => Ok(()),
        libc::AF_INET | libc::AF_INET6 => match inet {
            Some(a) if allowed.contains(&a.ip().to_canonical()) => Ok(()),
            other => Err(other),
        },
        _ => Err(None),
    }
}

/// The family of the address at `addr` (`len` bytes), and the internet address it names, if
/// it is one and is whole.
///
/// # Safety
/// `addr` points to `len` readable bytes (or is null).
unsafe fn read_addr(
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
) -> (i32, Option<SocketAddr>) {
    let len = len as usize;
    if addr.is_null() || len < std::mem::size_of::<libc::sa_family_t>() {
        return (-1, None);
    }
    // SAFETY: at least the family's bytes are readable (checked above); unaligned reads,
    // since a caller's buffer need not be aligned for the struct.
    let family = i32::from(unsafe { std::ptr::read_unaligned(addr.cast::<libc::sa_family_t>()) });
    let inet = match family {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: a whole sockaddr_in is readable (checked above).
            let a = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in>()) };
            Some(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: a whole sockaddr_in6 is readable (checked above).
            let a = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in6>()) };
            Some(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)),
                u16::from_be(a.sin6_port),
            ))
        }
        _ => None,
    };
    (family, inet)
}

/// `connect(2)`, as the C library's, for this executable and every library it loads; confined
/// by [`only`].
///
/// # Safety
/// As `connect(2)`: `addr` points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn connect(
    fd: libc::c_int,
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
) -> libc::c_int {
    if let Some(allowed) = ALLOWED.get() {
        // SAFETY: the caller's contract is connect(2)'s: `len` readable bytes at `addr`.
        let (family, inet) = unsafe { read_addr(addr, len) };
        if let Err(named) = check(allowed, family, inet) {
            if let Some(a) = named {
                *REFUSED.lock().unwrap_or_else(|p| p.into_inner()) = Some(a);
            }
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = libc::EACCES };
            return -1;
        }
    }
    // SAFETY: the system call with the caller's arguments, as the C library's connect makes it.
    unsafe { libc::syscall(libc::SYS_connect, fd, addr, len) as libc::c_int }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> Option<SocketAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn only_the_allowed_ips_and_local_sockets_pass() {
        let allowed = vec!["10.0.0.5".parse().unwrap()];
        assert_eq!(check(&allowed, libc::AF_INET, v4("10.0.0.5:4000")), Ok(()));
        assert_eq!(check(&allowed, libc::AF_UNIX, None), Ok(()));
        assert_eq!(check(&allowed, libc::AF_UNSPEC, None), Ok(()));
        assert_eq!(
            check(&allowed, libc::AF_INET, v4("127.0.0.1:6379")),
            Err(v4("127.0.0.1:6379"))
        );
        // A truncated internet address, and a family with no business here.
        assert_eq!(check(&allowed, libc::AF_INET, None), Err(None));
        assert_eq!(check(&allowed, libc::AF_PACKET, None), Err(None));
        // An IPv4-mapped IPv6 address is its IPv4 address.
        let mapped = v4("[::ffff:10.0.0.5]:4000");
        assert_eq!(check(&allowed, libc::AF_INET6, mapped), Ok(()));
        assert_eq!(
            check(&[], libc::AF_INET, v4("10.0.0.5:1")),
            Err(v4("10.0.0.5:1"))
        );
    }

    #[test]
    fn addresses_are_read_whole_or_not_at_all() {
        let a = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 4000u16.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(Ipv4Addr::new(10, 0, 0, 5)).to_be(),
            },
            sin_zero: [0; 8],
        };
        let p = (&a as *const libc::sockaddr_in).cast::<libc::sockaddr>();
        let whole = std::mem::size_of_val(&a) as libc::socklen_t;
        // SAFETY: `a` is a whole sockaddr_in on the stack.
        assert_eq!(
            unsafe { read_addr(p, whole) },
            (libc::AF_INET, v4("10.0.0.5:4000"))
        );
        // SAFETY: as above; a shorter length reads less.
        assert_eq!(unsafe { read_addr(p, 4) }, (libc::AF_INET, None));
        // SAFETY: a null address is not read.
        assert_eq!(unsafe { read_addr(std::ptr::null(), whole) }, (-1, None));
    }
}
