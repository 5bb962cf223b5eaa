// Types of model-store.js: the on-device model file in Cache Storage (declared with the fallback).

export { DeviceModelError, ModelStore } from "./rtgw-device.js";
