//! Enums whose numbers are part of the protocol, written once: each variant's number appears
//! only in its declaration, and the reverse lookup and the list of all variants are generated
//! from it.

/// Declares a `#[repr]` enum and gives it `ALL` (every variant, in declaration order) and
/// `from_number` (the variant for a wire number, if any).
macro_rules! numbered {
    (
        $(#[$meta:meta])*
        pub enum $name:ident: $repr:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $number:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        pub enum $name {
            $( $(#[$vmeta])* $variant = $number, )+
        }

        impl $name {
            /// Every variant, in the order declared.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The variant whose wire number is `n`, if there is one.
            pub const fn from_number(n: $repr) -> Option<$name> {
                match n {
                    $( $number => Some($name::$variant), )+
                    _ => None,
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use crate::{DType, ErrorCode};

    #[test]
    fn every_number_maps_back_to_its_variant() {
        for &d in DType::ALL {
            assert_eq!(DType::from_u8(d as u8), Some(d));
        }
        for &c in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_u16(c.as_u16()), c);
        }
        assert_eq!(DType::from_u8(200), None);
        assert_eq!(ErrorCode::from_u16(999), ErrorCode::Unknown);
        assert_eq!(DType::ALL.len(), 8);
        assert_eq!(ErrorCode::ALL.len(), 26);
    }
}
